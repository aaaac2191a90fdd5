"""Summary rows: one row of summary.csv per (run, task, metric), from a run's config, lm-eval results and
statistics.

The columns (SUMMARY_COLUMNS) are the run's settings (where summary_rows finds each in the config:
SUMMARY_FIELD_PATHS), lm-eval's value and stderr, and the sparsity statistics (STAT_SOURCES). The pipeline
appends them after each run (RunStore.append_summary); store/migrate.py rebuilds them from the run
directories.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .. import registry
from .provenance import code_commit, now

SUMMARY_COLUMNS: tuple[str, ...] = (
    "run_id",
    "model",
    "sparsifier",
    "placement",
    "k",
    "comp",
    "granularity",
    "layer_k",
    "calib_task",
    "calib_statistic",
    "sigma_add",
    "tac",
    "calib_documents",
    "calib_compensation",
    "empty_rows",
    "task",
    "num_fewshot",
    "fewshot_sampler",
    "target_kept",
    "target_measure",
    "calib_seed",
    "p",
    "lam",
    "calib_beyond",
    "limit",
    "metric",
    "value",
    "stderr",
    "kept_attention_fraction",
    "kept_vrow_fraction",
    "kept_attention_fraction_sparsified",
    "clamped_rows",
    "empty_row_count",
    "generated_tokens",
    "stats_scope",
    "git_commit",
    "phase",
    "timestamp",
    "rho",  # last ones: summaries written before they existed keep their columns where they were
    "head_weights",
)

# Where summary_rows finds each config-derived column: candidate dotted paths, the first one
# present wins (a mapping becomes a short label, see _cell). Pass `field_paths=` to summary_rows
# to adapt to another config layout, or `overrides=` to set a column outright.
SUMMARY_FIELD_PATHS: dict[str, tuple[str, ...]] = {
    "model": ("model.name", "model.id", "model"),
    "sparsifier": ("sparsifier.name", "sparsifier"),
    "placement": ("sparsifier.placement", "placement"),
    "k": ("sparsifier.k", "k"),
    "comp": ("comp.label", "comp.name", "comp", "sparsifier.comp"),
    "granularity": ("calib.granularity", "sparsifier.granularity", "granularity"),
    "layer_k": ("sparsifier.layer_k",),
    "calib_task": ("calib.task",),
    "calib_statistic": ("calib.statistic",),
    "sigma_add": ("calib.sigma_add",),
    "tac": ("calib.tac",),
    "calib_documents": ("calib.num_samples",),
    "calib_compensation": ("calib.compensation",),
    "empty_rows": ("sparsifier.empty_rows",),
    "num_fewshot": ("task.num_fewshot", "eval.num_fewshot", "num_fewshot"),
    "fewshot_sampler": ("task.fewshot_sampler",),
    "target_kept": ("sparsifier.target_kept",),
    "target_measure": ("sparsifier.target_measure",),  # what target_kept is a fraction of: attention | vrows
    "calib_seed": ("calib.seed",),
    "p": ("sparsifier.p",),  # top-p's probability mass
    "lam": ("sparsifier.lam",),  # skip-softmax's λ
    "rho": ("sparsifier.rho",),  # top-ρ's share of each row
    "head_weights": ("sparsifier.head_weights",),  # top-ρ's weights per (layer, head), as a digest (weights_digest)
    "calib_beyond": ("calib.beyond",),  # rows past the calibrated lengths: clamp (the default) or fit
    "limit": ("task.limit", "eval.limit", "limit"),
    "phase": ("phase",),
}

# Columns that describe sparsification: empty for a dense run, whatever its config holds.
SPARSE_ONLY_COLUMNS: tuple[str, ...] = ("placement", "k", "layer_k", "empty_rows", "p", "lam", "rho", "head_weights",
                                        "calib_beyond")

# Columns read from the run's statistics: column -> candidate keys of stats (the first present wins).
STAT_SOURCES: dict[str, tuple[str, ...]] = {
    "kept_attention_fraction": ("kept_attention_fraction",),
    "kept_vrow_fraction": ("kept_vrow_fraction",),
    "kept_attention_fraction_sparsified": ("kept_attention_fraction_sparsified",),  # layers outside layer_k
    "clamped_rows": ("clamped_rows",),  # rows longer than the calibrated lengths (θ of the longest one used)
    "empty_row_count": ("empty_rows", "empty_row_count"),  # Top-θ rows where nothing passed θ
    "generated_tokens": ("generated_tokens",),  # generation tasks: mean tokens per generated text
}
STAT_COLUMNS: tuple[str, ...] = tuple(STAT_SOURCES)


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def comp_label(comp: Mapping[str, Any]) -> str:
    """A compensation config as a short label: `none`, `sdc=exact`, `vmc`, `sdc=exact*0.9+vmc`.

    Reads the keys `sdc` (estimator or None), `sdc_scale` (shown when not 1) and `vmc` (bool), then adds the name of
    every other registered compensation the settings switch on (`comp.<name>`, toptheta.registry), e.g. `vmc+halfsdc`.
    """
    parts = []
    if comp.get("sdc"):
        scale = comp.get("sdc_scale", 1.0)
        parts.append(f"sdc={comp['sdc']}" + ("" if scale in (None, 1, 1.0) else f"*{scale}"))
    if comp.get("vmc"):
        parts.append("vmc")
    parts += [kind.name for kind in registry.active_compensations(dict(comp)) if kind.name not in ("sdc", "vmc")]
    return "+".join(parts) or "none"


def _cell(value: Any) -> Any:
    """A config value as one CSV cell: scalars as they are, lists joined, mappings labelled.

    A mapping with `sdc`/`vmc` keys gets comp_label; any other mapping lists its set entries
    (`key=value`, a bare `key` for True, None/False left out), or `none` when nothing is set.
    """
    if isinstance(value, Mapping):
        if {"sdc", "vmc"} & set(value):
            return comp_label(value)
        parts = [
            str(k) if v is True else f"{k}={_cell(v)}" for k, v in value.items() if v not in (None, False)
        ]
        return ",".join(parts) or "none"
    if isinstance(value, (list, tuple)):
        return ",".join(str(_cell(v)) for v in value)
    return value


def _first_present(config: Mapping[str, Any], paths: Sequence[str]) -> Any:
    for path in paths:
        value = _lookup(config, path)
        if value is not None:
            return _cell(value)
    return None


def _number_or_none(value: Any) -> float | None:
    """lm-eval reports missing stderrs as "N/A"; NaN also means no value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else value


def config_cells(
    config: Mapping[str, Any], field_paths: Mapping[str, Sequence[str]] = SUMMARY_FIELD_PATHS
) -> dict[str, Any]:
    """The summary cells a run's config alone determines, as summary.csv holds them (what summary_rows starts from;
    the per-run figures label runs with it, so both name a run alike).

    Each column of `field_paths` from its first present path (_cell), then the defaults a config leaves implicit:
    lm-eval's own few-shot sampler, the attention measure of a target, Top-θ's clamp rule, the number of prompts of
    a passkey/ruler task; Top-ρ's weights become their digest, and a dense run leaves the sparse-only columns empty.
    """
    cells = {column: _first_present(config, paths) for column, paths in field_paths.items()}
    kind, name = _lookup(config, "task.kind"), _lookup(config, "sparsifier.name")
    if cells.get("limit") is None and kind in ("passkey", "ruler"):
        cells["limit"] = _passkey_prompts(config)
    if cells.get("fewshot_sampler") is None and kind == "lm_eval":
        cells["fewshot_sampler"] = "default"  # lm-eval's per-question random draw
    if cells.get("target_kept") is not None and cells.get("target_measure") is None:
        cells["target_measure"] = "attention"  # the default measure (not in the run id when unset)
    if cells.get("calib_beyond") is None and name == "toptheta":
        cells["calib_beyond"] = "clamp"  # the rule before calib.beyond existed, and its default (not in the run id)
    if cells.get("head_weights") is not None:
        cells["head_weights"] = weights_digest(_lookup(config, "sparsifier.head_weights"))
    if name == "dense":
        cells.update({column: None for column in SPARSE_ONLY_COLUMNS})
    return cells


def summary_rows(
    run_id: str,
    config: Mapping[str, Any],
    lm_eval_results: Mapping[str, Any],
    stats: Mapping[str, Any] | None,
    *,
    field_paths: Mapping[str, Sequence[str]] = SUMMARY_FIELD_PATHS,
    overrides: Mapping[str, Any] | None = None,
    commit: str | None = None,
    timestamp: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (task, metric) in lm-eval's `results` section.

    metric is lm-eval's key, e.g. `acc,none` or `acc_norm,none`; stderr is the matching
    `acc_stderr,none` (None when lm-eval gives "N/A"). num_fewshot and limit come from what
    lm-eval actually used (`n-shot`, `config.limit`), falling back to the config. The statistics
    (STAT_SOURCES) come from `stats[task]` when present, else from `stats` for the task the run
    evaluated; a sub-task without its own numbers (a passkey length) gets none, and the
    `stats_scope` column says which (`task`, `run`, empty). A dense run leaves the sparse-only
    columns (SPARSE_ONLY_COLUMNS) empty. Other columns: see
    SUMMARY_FIELD_PATHS; `overrides` sets columns outright (applied last). `commit` defaults
    to code_commit(), `timestamp` to now (UTC).
    """
    stats = stats or {}
    base = config_cells(config, field_paths)
    base["run_id"] = run_id
    base["git_commit"] = commit if commit is not None else code_commit()
    base["timestamp"] = timestamp or now()
    used_limit = (lm_eval_results.get("config") or {}).get("limit")
    if used_limit is not None:
        base["limit"] = used_limit

    results = lm_eval_results.get("results") or {}
    own_tasks = {_lookup(config, "task.lm_eval_task"), _lookup(config, "task.name")} - {None}
    rows = []
    for task, metrics in results.items():
        task_stats, scope = _stats_for(task, stats, own=len(results) == 1 or task in own_tasks)
        fewshot = (lm_eval_results.get("n-shot") or {}).get(task)
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue  # alias/name/sample_len, or a stderr (reported with its metric)
            name, _, filt = key.partition(",")
            row = dict(base, task=task, metric=key)
            if fewshot is not None:
                row["num_fewshot"] = fewshot
            row["value"] = _number_or_none(value)
            row["stderr"] = _number_or_none(metrics.get(f"{name}_stderr,{filt}"))
            for column, keys in STAT_SOURCES.items():
                row[column] = next((task_stats[k] for k in keys if task_stats.get(k) is not None), None)
            row["stats_scope"] = scope
            rows.append(row | dict(overrides or {}))
    return rows


def weights_digest(weights: Sequence[Sequence[float]]) -> str:
    """A cell for a table of weights (Top-ρ's per (layer, head)): "w" and the first 8 hex digits of the SHA-256 of
    its JSON, with the floats as Python writes them, so two runs share a cell exactly when they share the weights."""
    text = json.dumps([[float(w) for w in row] for row in weights], separators=(",", ":"))
    return "w" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


FITTED_PARAMETERS = ("k", "p", "lam", "rho")  # what a matched-sparsity search chooses, by sparsifier setting name


def fitted_parameters(stats: Mapping[str, Any]) -> dict[str, Any]:
    """The parameter a matched-sparsity run's search chose (its stats.json ``target``: k, p or lam), by sparsifier
    setting name; {} for a run without a target."""
    target = stats.get("target")
    return {key: target[key] for key in FITTED_PARAMETERS if key in target} if isinstance(target, dict) else {}


def _passkey_prompts(config: Mapping[str, Any]) -> int | None:
    """How many prompts a passkey run (one per length and depth) or a ruler run (task.prompts_per_length per length)
    without a limit evaluates: its `limit` column, so runs over other lengths, depths or prompt counts form settings
    of their own, and a larger one supersedes a smaller one."""
    lengths, depths = _lookup(config, "task.lengths"), _lookup(config, "task.depths")
    if _lookup(config, "task.kind") == "ruler":
        per_length = _lookup(config, "task.prompts_per_length")
        return len(lengths) * per_length if lengths and per_length else None
    return len(lengths) * len(depths) if lengths and depths else None


def _stats_for(task: str, stats: Mapping[str, Any], *, own: bool) -> tuple[Mapping[str, Any], str | None]:
    """The statistics a row of `task` reports, and their scope.

    `task`: stats[task] holds this task's own numbers (e.g. one passkey length; for the task the run
    evaluated, the run's numbers fill what it lacks); `run`: the run's statistics, for the task the run
    evaluated; None: a sub-task (a passkey length, a group member) without its own numbers gets no
    statistics rather than the pooled ones of the whole run.
    """
    pooled = stats if own else {}
    if isinstance(stats.get(task), Mapping):
        return {**pooled, **stats[task]}, "task"
    return pooled, ("run" if own else None)
