import subprocess
import sys


def test_import_has_no_side_effects_on_transformers():
    """Importing toptheta registers nothing; a fresh interpreter, since other tests do register."""
    code = ("from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS; import toptheta; "
            "assert 'toptheta' not in ALL_ATTENTION_FUNCTIONS._global_mapping; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
