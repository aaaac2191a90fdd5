"""The copy of its thresholds a Top-θ run keeps in the store, small enough to track in git.

A run keeps the thresholds it used beside its results (`runs/<id>/thresholds.safetensors`), so its threshold
figures and storage table come from the store alone. The store is tracked in git, where files over
``COPY_LIMIT_BYTES`` (5 MB) do not belong, and a table calibrated on long rows passes it: Qwen2.5-Coder-0.5B
calibrated on documents of up to 12,912 tokens holds 24 layers × 14 heads × 12,913 lengths of θ and of counts,
34.7 MB, and 15 MB gzipped (float32 θ hardly compresses).

Such a run keeps `thresholds.sampled.safetensors` instead: θ (and every per-length tensor) at every s-th row
length and the longest one, exact at those lengths, with the smallest stride s that fits. Its header records the
stride, the full table's shape, size and sha256, and the run's original header, so a recalibration (the run's
command, or the cache at $TOPTHETA_CACHE/thresholds/<model>/<key>.safetensors, meta.json's thresholds_ref) can be
checked against it. It is a record, not thresholds to run with: ``Thresholds.load`` refuses it, naming the fix.

    python -m toptheta.store.threshold_copy [results_dir]   # sample copies over the limit already in the store
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..atomic import atomic_write

COPY_LIMIT_BYTES = 5_000_000
SAMPLED_SUFFIX = ".sampled.safetensors"
SAMPLED_KEY = "toptheta_sampled"  # the header key of a sampled copy; a full table's is "toptheta"


def sampled_name(name: str) -> str:
    """thresholds.safetensors -> thresholds.sampled.safetensors"""
    return name.removesuffix(".safetensors") + SAMPLED_SUFFIX


def keep_copy(source: str | Path, destination: Path, limit: int | None = None) -> Path:
    """Copy ``source`` to ``destination``, or its sampled form beside it when it is over ``limit`` bytes
    (``COPY_LIMIT_BYTES`` unless given)."""
    source, limit = Path(source), COPY_LIMIT_BYTES if limit is None else limit
    if source.stat().st_size <= limit:
        shutil.copyfile(source, destination)
        return destination
    return write_sampled(source, destination.with_name(sampled_name(destination.name)), limit)


def write_sampled(source: Path, destination: Path, limit: int = COPY_LIMIT_BYTES) -> Path:
    """Write the sampled form of thresholds file ``source`` (every s-th row length and the last one), ≤ ``limit``."""
    from safetensors import safe_open  # safetensors: not loaded by importing this module, only to read a file
    from safetensors.numpy import save_file

    try:
        with safe_open(str(source), framework="numpy") as fh:
            metadata = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception:  # safetensors raises several error types for files that are not safetensors
        metadata, tensors = {}, {}
    if "toptheta" not in metadata or "values" not in tensors:
        raise ValueError(f"{source} is over {limit} bytes and not a toptheta thresholds file, so the run store cannot "
                         "keep it in git; keep it elsewhere and record its path")
    lengths_n = tensors["values"].shape[-1]  # (layers, heads or 1, row lengths or 1)
    size = source.stat().st_size
    record = {"header": json.loads(metadata["toptheta"]), "shape": list(tensors["values"].shape), "bytes": size,
              "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    stride = max(2, math.ceil(size / limit))
    while stride < lengths_n:
        lengths = np.unique(np.append(np.arange(0, lengths_n, stride), lengths_n - 1))
        # per-length tensors share values' last axis; anything else is kept whole
        sampled = {name: np.ascontiguousarray(t[..., lengths]) if t.shape[-1:] == (lengths_n,) else t
                   for name, t in tensors.items()}
        sampled["lengths"] = lengths.astype(np.int64)
        header = {SAMPLED_KEY: json.dumps({**record, "stride": int(stride)})}
        atomic_write(destination, lambda tmp: save_file(sampled, tmp, metadata=header))
        if destination.stat().st_size <= limit:
            return destination
        stride = math.ceil(stride * 1.25)
    destination.unlink(missing_ok=True)
    raise ValueError(f"{source} cannot be sampled under {limit} bytes (its row-length axis has {lengths_n} entries), "
                     "so the run store cannot keep a copy in git; keep it elsewhere and record its path")


def read_sampled(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors expanded to every row length, NaN between the kept ones; the record) of a sampled copy."""
    from safetensors import safe_open  # safetensors: not loaded by importing this module, only to read a file

    with safe_open(str(path), framework="numpy") as fh:
        record = json.loads((fh.metadata() or {})[SAMPLED_KEY])
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    lengths = tensors.pop("lengths")
    full = {}
    for name, t in tensors.items():
        if t.shape[-1:] == lengths.shape:
            full[name] = np.full((*t.shape[:-1], record["shape"][-1]), np.nan, dtype=np.float32)
            full[name][..., lengths] = t
        else:
            full[name] = t
    return full, record


def sample_store(results_dir: str | Path, limit: int = COPY_LIMIT_BYTES) -> list[Path]:
    """Replace every run's thresholds copy over ``limit`` bytes with its sampled form; the sampled files written."""
    written = []
    for path in sorted(Path(results_dir, "runs").glob("*/*.safetensors")):
        if path.name.endswith(SAMPLED_SUFFIX) or path.stat().st_size <= limit:
            continue
        written.append(write_sampled(path, path.with_name(sampled_name(path.name)), limit))
        path.unlink()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results_dir", nargs="?", default="results")
    args = parser.parse_args(argv)
    for path in sample_store(args.results_dir):
        print(f"{path}: {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
