"""Threshold storage per model (issue 10 item 11): one θ per (layer, head, row length).

Computed: layers × query heads × row lengths × bytes per value. Assumptions, stated in the table:
the row lengths are every integer up to the longest calibrated row (the lookup table is dense), and
a value is 2 bytes (fp16, as the paper's "~12 MB for LLaMA-3-70B": 80 × 64 × ~1.2k × 2 B). Two row
ranges are listed: 1,200 (about the longest 25-shot ARC row, the paper's calibration) and the
model's full context. Measured: the safetensors threshold files found in the store's run
directories (`runs/<id>/*.safetensors`, the copy a run keeps of the thresholds it used): their
`values` shape and bytes as stored (float32), read from the file header alone.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pandas as pd

from ..store.threshold_copy import SAMPLED_KEY

# name: (layers, query heads, context) from the models' configs.
MODEL_SHAPES = {
    "smollm2-135m": (30, 9, 8192),
    "qwen2.5-coder-0.5b": (24, 14, 32768),
    "gemma3-270m": (18, 4, 32768),
    "llama2-7b": (32, 32, 4096),
    "llama3-8b": (32, 32, 8192),
    "llama3-70b": (80, 64, 8192),
}
PAPER_ROWS = 1200
BYTES_FP16 = 2
_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4}


def threshold_bytes(layers: int, heads: int, rows: int, bytes_per_value: int = BYTES_FP16) -> int:
    """One θ per (layer, head, row length 1..rows)."""
    return layers * heads * rows * bytes_per_value


def computed_table(shapes: dict[str, tuple[int, int, int]] = MODEL_SHAPES) -> pd.DataFrame:
    rows = []
    for model, (layers, heads, context) in shapes.items():
        for label, n in ((f"{PAPER_ROWS} (25-shot ARC)", PAPER_ROWS), ("full context", context)):
            size = threshold_bytes(layers, heads, n)
            rows.append({"model": model, "layers": layers, "heads": heads, "row_lengths": n, "assumption": label,
                         "bytes_fp16": size, "MB": round(size / 1e6, 6), "source": "computed"})
    return pd.DataFrame(rows)


def safetensors_header(path: str | Path) -> dict:
    """A safetensors file's JSON header: {tensor name: {shape, dtype, ...}, "__metadata__": {...}} (nothing else is read)."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(length))


def measured_table(results_dir: str | Path) -> pd.DataFrame:
    """One row per distinct threshold file kept in the store's run directories (a sampled copy, see
    store/threshold_copy.py, as the full table it records)."""
    rows, seen = [], set()
    for path in sorted(Path(results_dir, "runs").glob("*/*.safetensors")):
        config_path = path.parent / "config.json"
        model = json.loads(config_path.read_text())["model"].get("name") if config_path.is_file() else ""
        header = safetensors_header(path)
        if "values" not in header:
            continue
        shape, dtype, size = header["values"]["shape"], header["values"]["dtype"], path.stat().st_size
        sampled = (header.get("__metadata__") or {}).get(SAMPLED_KEY)
        if sampled:
            record = json.loads(sampled)
            shape, size = record["shape"], record["bytes"]
        key = (model, tuple(shape), size)
        if key in seen:
            continue
        seen.add(key)
        layers, heads, rows_n = (shape + [1, 1, 1])[:3]
        stored = layers * heads * rows_n * _DTYPE_BYTES.get(dtype, 4)
        rows.append({"model": model, "layers": layers, "heads": heads, "row_lengths": rows_n - 1 if rows_n > 1 else 1,
                     "assumption": f"calibrated file ({dtype} values), run {path.parent.name}",
                     "bytes_fp16": threshold_bytes(layers, heads, max(rows_n - 1, 1)), "MB": round(stored / 1e6, 6),
                     "source": f"measured: {size} bytes on disk" + (" (the run keeps it sampled)" if sampled else "")})
    return pd.DataFrame(rows, columns=["model", "layers", "heads", "row_lengths", "assumption", "bytes_fp16", "MB",
                                       "source"])


def storage_table(results_dir: str | Path | None = None) -> pd.DataFrame:
    """Computed sizes for the offline models and LLaMA-2-7B / LLaMA-3-8B / LLaMA-3-70B, then measured files."""
    table = computed_table()
    if results_dir is not None:
        measured = measured_table(results_dir)
        if len(measured):
            table = pd.concat([table, measured], ignore_index=True)
    return table
