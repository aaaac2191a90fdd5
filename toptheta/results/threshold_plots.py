"""Calibrated thresholds as figures (method.md §10, reference notebook 2 and plot_th_llama.py).

Reads the safetensors threshold files a run keeps in its directory (`runs/<id>/*.safetensors`, every s-th
row length of tables over 5 MB: store/threshold_copy.py;
`values` is (layers, heads or 1, row lengths or 1), NaN where a row length was never calibrated, and
`counts` the calibration samples behind each value). Two figures per file: the histogram of θ per
layer (all heads and row lengths), and θ against the row length n for a few layers, one line per head.
The reference notebook histograms the per-sample (k+1)-th largest scores; we keep only their mean +
σ_add·std per (layer, head, n), so the histogram is over calibrated values.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..store.threshold_copy import SAMPLED_SUFFIX, read_sampled


def threshold_files(results_dir: str | Path) -> list[Path]:
    """Threshold files kept in run directories, one per distinct content (every run names its copy
    thresholds.safetensors, so files are told apart by a hash of their bytes)."""
    seen, out = set(), []
    for path in sorted(Path(results_dir, "runs").glob("*/*.safetensors")):
        key = hashlib.sha256(path.read_bytes()).hexdigest()
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def load_values(path: str | Path) -> tuple[np.ndarray, np.ndarray | None, dict]:
    """(values, counts or None, header) of a threshold file, as numpy (no torch). A run's sampled copy
    (store/threshold_copy.py) reads as its full table with NaN at the row lengths it left out."""
    from safetensors import safe_open  # safetensors: not loaded by importing this module, only to read a file

    if str(path).endswith(SAMPLED_SUFFIX):
        tensors, record = read_sampled(path)
        return tensors["values"], tensors.get("counts"), {**record["header"], "sampled_stride": record["stride"]}
    with safe_open(str(path), framework="numpy") as fh:
        values = fh.get_tensor("values")
        counts = fh.get_tensor("counts") if "counts" in fh.keys() else None
        header = json.loads((fh.metadata() or {}).get("toptheta", "{}"))
    return values, counts, header


def summary_table(path: str | Path) -> pd.DataFrame:
    """Per layer: calibrated entries, θ min / median / max, the longest calibrated row length, k."""
    values, _, header = load_values(path)
    rows = []
    for layer in range(values.shape[0]):
        v = values[layer]
        known = v[~np.isnan(v)]
        lengths = np.nonzero(~np.isnan(v).all(0))[0]
        rows.append({"layer": layer, "k": (header.get("k") or [None] * values.shape[0])[layer],
                     "entries": int(known.size), "theta_min": float(known.min()) if known.size else None,
                     "theta_median": float(np.median(known)) if known.size else None,
                     "theta_max": float(known.max()) if known.size else None,
                     "max_n": int(lengths.max()) if values.shape[2] > 1 and lengths.size else None})
    return pd.DataFrame(rows)


def histogram_figure(path: str | Path, layers: list[int] | None = None, title: str = "") -> Figure:
    values, _, header = load_values(path)
    layers = layers if layers is not None else _spread(values.shape[0])
    fig = Figure(figsize=(7, 2.2 * ((len(layers) + 1) // 2)), layout="constrained")
    axes = fig.subplots((len(layers) + 1) // 2, 2, squeeze=False).ravel()
    for ax, layer in zip(axes, layers):
        known = values[layer][~np.isnan(values[layer])]
        if known.size:
            ax.hist(known, bins=40, color="tab:blue", alpha=0.8)
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.set_xlabel(f"θ ({header.get('placement', '')}-softmax)", fontsize=7)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    fig.suptitle(f"Top-θ calibrated thresholds per layer {title}{_sampled(header)}".strip(), fontsize=9)
    return fig


def theta_vs_length_figure(path: str | Path, layers: list[int] | None = None, heads: int = 4,
                           title: str = "") -> Figure:
    values, _, header = load_values(path)
    layers = layers if layers is not None else _spread(values.shape[0])
    fig = Figure(figsize=(7, 2.2 * ((len(layers) + 1) // 2)), layout="constrained")
    axes = fig.subplots((len(layers) + 1) // 2, 2, squeeze=False).ravel()
    n = np.arange(values.shape[2])
    for ax, layer in zip(axes, layers):
        for head in range(min(heads, values.shape[1])):
            row = values[layer, head]
            ax.plot(n[~np.isnan(row)], row[~np.isnan(row)], lw=1, label=f"head {head}")
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.set_xlabel("row length n", fontsize=7)
        ax.set_ylabel("θ", fontsize=7)
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=6)
    fig.suptitle(f"Top-θ: θ against row length {title}{_sampled(header)}".strip(), fontsize=9)
    return fig


def _sampled(header: dict) -> str:
    stride = header.get("sampled_stride")
    return f" (every {stride}th row length and the last: the run's copy is sampled)" if stride else ""


def _spread(num_layers: int) -> list[int]:
    """Layers 0, 1, the middle and the last (the reference notebook's choice for LLaMA: 0, 1, 10, 31)."""
    return sorted({0, min(1, num_layers - 1), num_layers // 2, num_layers - 1})
