"""Figures from the run directories rather than summary.csv: per-layer kept fractions and V-row popularity.

Each run directory's stats.json holds per-layer lists (SparsityStats.per_layer) and, for runs with
task.vrow_popularity, the decode steps' V-row counts; config.json says which run it was.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..store.rows import SUMMARY_FIELD_PATHS, config_cells
from ..store.runs import DONE_MARKER
from ..store.samples import read_samples, samples_path
from .figures import X_LABELS
from .labels import series_label
from .selection import as_number


def config_row(config: Mapping[str, Any]) -> dict[str, Any]:
    """The summary columns a run config determines, as summary.csv writes them (store.rows.config_cells)."""
    return config_cells(config)


def runs_table(results_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """One row per complete run directory (DONE present): run_id, path, config columns, series, task_name,
    and has_layers (whether its stats.json holds per-layer lists)."""
    rows = []
    for run_dir in sorted(Path(results_dir, "runs").glob("*/")):
        if not (run_dir / DONE_MARKER).is_file() or not (run_dir / "config.json").is_file():
            continue
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        row = config_row(config)
        task = config.get("task")
        row.setdefault("task", task.get("lm_eval_task") or task.get("name") if isinstance(task, Mapping) else task)
        rows.append({"run_id": run_dir.name, "path": str(run_dir), **row, "series": series_label(row),
                     "task_name": task.get("name") if isinstance(task, Mapping) else task,
                     "has_layers": bool(_layer_stats(run_dir))})
    return pd.DataFrame(rows, columns=["run_id", "path", *SUMMARY_FIELD_PATHS, "task", "series", "task_name",
                                       "has_layers"])


def per_layer_groups(results_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Sparse runs with per-layer statistics, grouped by (model, task, series) and sorted by k.

    Each item: model, task, series, title, run_dirs (the argument of per_layer_figure / per_layer_table).
    Dense runs are left out: they keep everything in every layer.
    """
    runs = runs_table(results_dir)
    runs = runs[(runs["series"] != "Baseline") & runs["has_layers"].astype(bool)]
    groups = []
    for (model, task, series), rows in runs.groupby(["model", "task_name", "series"], dropna=False, sort=True):
        rows = rows.assign(k=pd.to_numeric(rows["k"], errors="coerce")).sort_values("k", kind="stable")
        groups.append({"model": model, "task": task, "series": series, "title": f"{model} · {task} · {series}",
                       "run_dirs": list(rows["path"])})
    return groups


def _layer_stats(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The per-layer lists of a run's stats.json ({} when it has none).

    Runs store them under "per_layer"; runs written before that kept them at the top level, where
    they had replaced the scalar fractions of the same names.
    """
    path = Path(run_dir) / "stats.json"
    stats = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    layers = stats.get("per_layer", stats)
    return layers if isinstance(layers, dict) and isinstance(layers.get("layer"), list) else {}


def run_label(run_dir: str | os.PathLike[str]) -> str:
    """'Top-θ post (+VMC), k=64' from a run directory's config.json (its run id when there is none)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return Path(run_dir).name
    row = config_row(json.loads(path.read_text(encoding="utf-8")))
    k = as_number(row.get("k"))
    return series_label(row) + (f", k={k}" if k is not None else "")


def per_layer_table(run_dirs: Sequence[str | os.PathLike[str]], labels: Sequence[str] | None = None) -> pd.DataFrame:
    """Long format: run_id, label, layer, kept_attention_fraction, kept_vrow_fraction, mean_dropped_mass.

    Read from each run's stats.json (the per-layer lists SparsityStats.per_layer writes); runs
    without them are skipped.
    """
    frames = []
    for i, run_dir in enumerate(run_dirs):
        stats = _layer_stats(run_dir)
        if not stats:
            continue
        frame = pd.DataFrame({"layer": stats["layer"]})
        for col in ("kept_attention_fraction", "kept_vrow_fraction", "mean_dropped_mass"):
            values = stats.get(col)
            frame[col] = pd.to_numeric(pd.Series(values if isinstance(values, list) else [None] * len(frame)),
                                       errors="coerce")
        frame.insert(0, "label", labels[i] if labels else run_label(run_dir))
        frame.insert(0, "run_id", Path(run_dir).name)
        frames.append(frame)
    columns = ["run_id", "label", "layer", "kept_attention_fraction", "kept_vrow_fraction", "mean_dropped_mass"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def per_layer_inputs(run_dirs: Sequence[str | os.PathLike[str]]) -> list[Any]:
    """What per_layer_table and per_layer_figure read: each run's id, and its stats.json and config.json where it has
    them (paths, so a render record can digest their bytes)."""
    inputs: list[Any] = []
    for run_dir in run_dirs:
        inputs.append(Path(run_dir).name)
        files = (Path(run_dir) / "stats.json", Path(run_dir) / "config.json")
        inputs += [p if p.is_file() else f"no {p.name}" for p in files]
    return inputs


def per_layer_figure(run_dirs: Sequence[str | os.PathLike[str]], *, stat: str = "kept_attention_fraction",
                     labels: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """`stat` per layer from each run's stats.json, one line per run."""
    table = per_layer_table(run_dirs, labels)
    if table.empty:
        raise ValueError(f"none of the {len(run_dirs)} run directories has per-layer lists in stats.json")
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for (_, label), rows in table.groupby(["run_id", "label"], sort=False):
        ax.plot(rows["layer"], rows[stat], marker="o", ms=3, lw=1.2, label=label)
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(X_LABELS.get(stat, stat))
    ax.set_ylim(0, 1.05 if stat in X_LABELS else None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def vrow_popularity_records(results_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Runs that recorded V-row popularity (task.vrow_popularity): run_id, model, task, label and the record
    (layer, group, heads_per_group, steps, counts), sorted by model, label and layer."""
    records = []
    runs = runs_table(results_dir)
    for row in runs.itertuples(index=False):
        path = Path(row.path) / "stats.json"
        record = json.loads(path.read_text(encoding="utf-8")).get("vrow_popularity") if path.is_file() else None
        if isinstance(record, dict) and record.get("counts"):
            records.append({"run_id": row.run_id, "model": row.model, "task": row.task_name,
                            "label": run_label(row.path), "record": record, "problem": _first_problem(row.path)})
    return sorted(records, key=lambda r: (str(r["model"]), r["label"], r["record"]["layer"], r["run_id"]))


def _first_problem(run_dir: str | os.PathLike[str]) -> str | None:
    """The id of a run's first generation (its first sample: HumanEval's task_id, passkey's id), which a V-row
    popularity recording follows; None without samples."""

    path = samples_path(run_dir)
    samples = read_samples(path) if path is not None else None
    if isinstance(samples, Mapping):
        samples = next(iter(samples.values()), None)
    first = samples[0] if isinstance(samples, list) and samples and isinstance(samples[0], Mapping) else {}
    problem = next((first[k] for k in ("task_id", "id", "doc_id") if k in first), None)
    return None if problem is None else str(problem)


def vrow_popularity_table(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Per record: how far the union of a group's kept V rows exceeds one head's kept set (the decode cost).

    Means over decode steps of: keys, V rows read (kept by any head of the group), V rows kept per head, and
    their ratio (1 = the heads keep the same rows; heads per group = disjoint sets)."""
    rows = []
    for item in records:
        rec = item["record"]
        heads = rec.get("heads_per_group") or 1
        keys, union, per_head = [], [], []
        for step, counts in enumerate(rec["counts"]):
            width = len(counts) - (len(rec["counts"]) - 1 - step)  # step i saw i + 1 fewer keys than the last
            keys.append(width)
            union.append(sum(1 for c in counts if c > 0))
            per_head.append(sum(counts) / heads)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        rows.append({"model": item["model"], "task": item["task"], "problem": item.get("problem"),
                     "series": item["label"], "layer": rec["layer"],
                     "group": rec["group"], "heads_per_group": heads, "decode_steps": len(keys),
                     "mean_keys": mean(keys), "mean_vrows_read": mean(union), "mean_vrows_per_head": mean(per_head),
                     "union_over_per_head": mean(union) / mean(per_head) if mean(per_head) else math.nan,
                     "run_id": item["run_id"]})
    return pd.DataFrame(rows)


def vrow_popularity_figure(record: Mapping[str, Any], *, title: str | None = None) -> Figure:
    """Heatmap: decode step × key position, colour = query heads of the KV group keeping that V row; grey: keys
    that did not exist yet at that step (each step of the generation sees one key more than the last)."""
    counts = np.asarray(record["counts"], dtype=float)
    if counts.ndim == 2 and counts.size:
        steps, width = counts.shape
        first = width - (steps - 1)  # keys seen by the first step
        future = np.arange(width)[None, :] >= first + np.arange(steps)[:, None]
        counts = np.ma.masked_array(counts, mask=future)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=0, vmax=record.get("heads_per_group") or None)
    fig.colorbar(image, ax=ax, label="query heads keeping the V row")
    ax.set_xlabel("key position")
    ax.set_ylabel("decode step")
    ax.set_title("\n".join(textwrap.wrap(title or f"layer {record['layer']}, KV group {record['group']}", width=95)),
                 fontsize=8.5)
    return fig


def results_dir_from_env(default: str = "results") -> Path:
    """$TOPTHETA_RESULTS_DIR, else `default`; a relative path missing here is looked up in the parent directory
    (a notebook runs in notebooks/, the results live at the repository root)."""
    path = Path(os.environ.get("TOPTHETA_RESULTS_DIR") or default)
    if not path.is_absolute() and not path.exists() and (Path.cwd().parent / path).exists():
        return Path.cwd().parent / path
    return path
