import pytest


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch):
    """A TOPTHETA_DATA_DIR in the caller's shell must not change what the tests see."""
    monkeypatch.delenv("TOPTHETA_DATA_DIR", raising=False)
