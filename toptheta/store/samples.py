"""Per-sample logs in a run directory: lm-eval's per-question records, gzipped JSON (samples.json.gz).

The paired statistics (results/paired.py) and the informative-question filters read them back to compare
two runs question by question; the run store writes them (RunStore.write_run).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

SAMPLES_FILE = "samples.json.gz"


def jsonable(obj: Any) -> Any:
    """json.dump's fallback: NumPy/torch scalars and arrays, paths, sets; anything else as str.

    lm-eval's results hold a few non-JSON values (NumPy numbers, callables in task configs);
    like lm-eval's own writer we keep them readable rather than fail a finished run.
    """
    if hasattr(obj, "tolist"):  # NumPy scalars/arrays, torch tensors
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def dumps(obj: Any) -> str:
    """Indented JSON text of a run file; key order kept as given (sort_keys would fail on dicts mixing int and
    str keys)."""
    return json.dumps(obj, indent=2, default=jsonable) + "\n"


def compress_json(obj: Any) -> bytes:
    """gzip of the JSON text, with no timestamp in the header: the same samples give the same bytes.
    Per-sample logs are ~1.3 MB of JSON per 500-question run and compress about tenfold."""
    return gzip.compress(dumps(obj).encode("utf-8"), compresslevel=9, mtime=0)


def samples_path(run_dir: str | Path) -> Path | None:
    """A run directory's per-sample file; None without one."""
    path = Path(run_dir) / SAMPLES_FILE
    return path if path.is_file() else None


def read_samples(path: str | Path) -> Any:
    """The per-sample logs in a samples file (see samples_path)."""
    return json.loads(gzip.decompress(Path(path).read_bytes()))
