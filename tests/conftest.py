import os

import pytest

# Triton decides between its interpreter and its compiler when it is first imported (its own library functions,
# tl.zeros and the like, are decorated then), and any test module may import it first through the backends: the
# whole session runs Triton's interpreter unless the caller asks for compiled kernels (TRITON_INTERPRET=0 on a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch):
    """A TOPTHETA_DATA_DIR in the caller's shell must not change what the tests see."""
    monkeypatch.delenv("TOPTHETA_DATA_DIR", raising=False)
