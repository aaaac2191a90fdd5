"""Weights & Biases logging: one wandb run per evaluated configuration, comparable across a sweep.

Every run the pipeline computes (the dense baseline and the sparse run are two) becomes its own wandb
run, named after its settings and grouped by the sweep (``logger.group``, else Hydra's sweep directory),
with flat metric keys (``acc_norm``, ``acc_norm_stderr``, ``kept_attention_fraction``, ...) and the
settings as flat config keys (``sparsifier``, ``placement``, ``k``, ``comp``, ``granularity``, ...), so
wandb's runs table and parallel-coordinates plot compare a whole sweep. The thresholds a run used are
logged as an artifact (type ``thresholds``).

Mode: ``logger.mode`` when set, else ``$WANDB_MODE``, else offline (``wandb sync wandb/offline-run-*``
uploads later). With ``logger=none`` wandb is never imported.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..store.rows import FITTED_PARAMETERS, STAT_COLUMNS

MODES = ("offline", "online", "disabled", "dryrun", "run")  # the last two: wandb's legacy names
NOT_CONFIG = {"metric", "value", "stderr", "timestamp"}  # row columns that are results, not settings


class NullLogger:
    def log_run(self, spec, rows, stats, thresholds_path=None) -> None:
        pass

    def finish(self) -> None:
        pass


def resolve_mode(mode: str | None) -> str:
    """``mode``, else $WANDB_MODE, else ``offline``; an unknown value fails naming the valid ones."""
    resolved = mode or os.environ.get("WANDB_MODE") or "offline"
    if resolved not in MODES:
        source = "logger.mode" if mode else "$WANDB_MODE"
        raise ValueError(f"{source}={resolved!r}; valid: offline (default), online, disabled")
    return resolved


def metric_key(task: str, metric: str, several_tasks: bool) -> str:
    """lm-eval's ``acc_norm,none`` -> ``acc_norm``; another filter stays (``exact_match/strict-match``)."""
    name, _, filt = metric.partition(",")
    key = name if filt in ("", "none") else f"{name}/{filt}"
    return f"{task}/{key}" if several_tasks else key


def run_metrics(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> dict[str, float]:
    """Flat metric keys: each (task, metric) of the summary rows, its stderr, and the sparsity statistics."""
    several = len({r["task"] for r in rows}) > 1
    out = {}
    for row in rows:
        key = metric_key(row["task"], row["metric"], several)
        if row.get("value") is not None:
            out[key] = row["value"]
        if row.get("stderr") is not None:
            out[f"{key}_stderr"] = row["stderr"]
    out.update({k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def run_config(spec, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Flat settings (the summary-row columns, plus SDC/VMC) and the whole run config under ``run``."""

    first = rows[0] if rows else {}
    flat = {k: v for k, v in first.items() if k not in NOT_CONFIG and k not in STAT_COLUMNS}
    flat.update(run_id=spec.run_id, label=spec.label, sdc=spec.comp.sdc, vmc=spec.comp.vmc,
                sdc_scale=spec.comp.sdc_scale, tasks=sorted({r["task"] for r in rows}))
    return {**flat, "run": spec.stored_config()}


def run_name(spec, rows: Sequence[Mapping[str, Any]]) -> str:
    """E.g. ``smollm2-135m toptheta-post k=64 vmc arc_easy [1a2b3c4d]``."""
    first = rows[0] if rows else {}
    parts = [first.get("model"), spec.label]
    for key in FITTED_PARAMETERS:  # the budget, or a baseline's parameter
        if first.get(key) not in (None, ""):
            parts.append(f"{key}={first[key]}")
    if first.get("calib_beyond") == "fit":
        parts.append("beyond=fit")
    if first.get("comp") not in (None, "", "none"):
        parts.append(str(first["comp"]))
    parts.extend(sorted({r["task"] for r in rows}))
    return " ".join(str(p) for p in parts if p) + f" [{spec.run_id[:8]}]"


class WandbLogger:
    """Opens, fills and finishes one wandb run per ``log_run`` call."""

    def __init__(self, options: Mapping[str, Any], context: Mapping[str, Any] | None = None):
        import wandb  # wandb: optional, only with a wandb logger

        self.wandb = wandb
        self.options = dict(options)
        self.mode = resolve_mode(self.options.get("mode"))
        context = dict(context or {})
        self.group = self.options.get("group") or context.get("sweep")
        self.tags = [*list(self.options.get("tags") or []), *([context["job"]] if context.get("job") else [])]

    def log_run(self, spec, rows, stats, thresholds_path: str | os.PathLike[str] | None = None) -> None:
        run = self.wandb.init(project=self.options.get("project") or "toptheta", entity=self.options.get("entity"),
                              mode=self.mode, group=self.group, job_type=spec.label, name=run_name(spec, rows),
                              tags=self.tags, config=run_config(spec, rows))
        try:
            run.log(run_metrics(rows, stats.summary()))
            per_layer = stats.per_layer()
            columns = list(per_layer)
            data = [list(values) for values in zip(*(per_layer[c] for c in columns))]
            run.log({"per_layer": self.wandb.Table(columns=columns, data=data)})
            if thresholds_path:
                run.log_artifact(self._thresholds_artifact(Path(thresholds_path), spec))
        finally:
            run.finish()

    def _thresholds_artifact(self, path: Path, spec):
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"thresholds-{spec.model.name or 'model'}-{path.stem}")
        metadata = {"calibration": spec.calib.settings if spec.calib else None, "sparsifier": spec.sparsifier.settings}
        artifact = self.wandb.Artifact(name, type="thresholds", metadata=metadata)
        artifact.add_file(str(path), name="thresholds.safetensors")
        return artifact

    def finish(self) -> None:
        self.wandb.teardown()  # stop wandb's background service: a finished pipeline leaves no process behind


def make_logger(options: Mapping[str, Any], context: Mapping[str, Any] | None = None):
    """``options``: the logger config group; ``context``: ``sweep`` (the wandb group) and ``job`` (a tag)."""
    name = options.get("name", "none")
    if name == "none":
        return NullLogger()
    if name == "wandb":
        return WandbLogger(options, context)
    raise ValueError(f"logger={name!r}; valid: none, wandb")
