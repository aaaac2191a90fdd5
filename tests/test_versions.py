"""The supported range of transformers and lm-eval (issue 32 item 5): scripts/check_versions.py runs the tests that
reach into either library against the lowest and the highest release pyproject.toml allows. The slow test does the
real run (two overlay installs from the package index, ~8 minutes on 2 cores) and skips without the index; the fast
ones check how the script reads the pins and picks its tests."""

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("check_versions", ROOT / "scripts" / "check_versions.py")
check_versions = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_versions)


def _pyproject(tmp_path, *dependencies):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\ndependencies = [\n' + "".join(f'  "{d}",\n' for d in dependencies) + "]\n")
    return path


def test_the_lowest_combination_is_each_lower_bound_and_the_highest_is_the_whole_requirement(tmp_path):
    path = _pyproject(tmp_path, "torch>=2.4,<2.15", "transformers>=5.24,<5.26", "lm_eval>=0.4.13,<0.5")
    lowest, highest = check_versions.pinned_combinations(path)
    assert lowest == "transformers==5.24 lm_eval==0.4.13"
    # pip resolves a range to the newest release in it, which is the highest supported one
    assert sorted(highest.split()) == ["lm_eval<0.5,>=0.4.13", "transformers<5.26,>=5.24"]


def test_a_pin_without_a_lower_bound_names_itself(tmp_path):
    path = _pyproject(tmp_path, "transformers<5.26", "lm-eval>=0.4.13,<0.5")
    with pytest.raises(SystemExit, match="transformers<5.26 needs exactly one '>=' bound"):
        check_versions.pinned_combinations(path)


def test_the_subset_is_every_test_file_importing_either_library_and_the_ones_reaching_them_through_toptheta(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("import torch\nfrom transformers import LlamaConfig\n")
    (tests / "test_b.py").write_text("def test():\n    from lm_eval.models.huggingface import HFLM\n")
    (tests / "test_c.py").write_text('"""Says transformers in prose only."""\nimport toptheta\n')
    (tests / "test_d.py").write_text("import transformers_stream_generator\n")  # another package's name
    (tests / "helpers_x.py").write_text("import transformers\n")  # not a test file
    (tests / "test_decode_step.py").write_text("import toptheta\n")  # listed in THROUGH_TOPTHETA
    assert check_versions.subset(tmp_path) == ["tests/test_a.py", "tests/test_b.py", "tests/test_decode_step.py"]


def test_the_real_subset_holds_the_attention_and_lm_eval_tests():
    chosen = check_versions.subset()
    for name in ("test_attention.py", "test_attention_correctness.py", "test_lm_eval_cli.py", "test_prefix_cache.py",
                 "test_tasks.py", *(Path(f).name for f in check_versions.THROUGH_TOPTHETA)):
        assert f"tests/{name}" in chosen


def _index_reachable() -> bool:
    """Whether the package index answers (PIP_INDEX_URL where set, else PyPI)."""
    url = urlparse(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple"))
    if url.scheme == "file":
        return Path(url.path).exists()
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow  # two installs and two runs of the subset: ~8 minutes on 2 cores
def test_the_lowest_and_highest_supported_releases_pass(tmp_path):
    if not _index_reachable():
        pytest.skip("the package index is not reachable: the releases cannot be installed")
    done = subprocess.run([sys.executable, "scripts/check_versions.py", "--pinned", "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=2 * 1000)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert report.count("   PASS  ") == 2, report
