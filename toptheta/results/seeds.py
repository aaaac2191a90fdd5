"""Calibration seeds: the runs of one configuration that differ only in `calib_seed` count as one measurement.

A Top-θ configuration calibrated on several disjoint draws of calibration documents (`calib.seed`, summary
column `calib_seed`) is one series point whose spread over the draws belongs in its interval. `merge_seeds`
folds such runs of a trade-off table (or comparisons.store_rows) into one row: the means of the measured columns,
`run_ids` listing the runs (one per seed) and `seeds` their number. paired.seeded_outcomes and the pooled
bootstrap then resample the seeds as well as the questions.
"""

from __future__ import annotations

import pandas as pd

# Measured per run: averaged over the seeds of a configuration. Every other column identifies the configuration.
MEASURED = ("value", "stderr", "kept_attention_fraction", "kept_vrow_fraction", "kept_attention_fraction_sparsified",
            "attention_reduction", "vrow_reduction", "clamped_rows", "empty_row_count", "generated_tokens")
PER_RUN = ("run_id", "calib_seed", "value_pm_stderr", "timestamp", "git_commit", "phase")


def merge_seeds(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: runs equal on every identifying column and differing in calib_seed are merged
    (measured columns averaged, `run_ids` a tuple of their run ids in seed order, `seeds` their count,
    `calib_seed` the seeds joined by commas); every other row is kept with run_ids = (run_id,), seeds = 1."""
    if rows.empty:
        return rows.assign(run_ids=pd.Series(dtype=object), seeds=pd.Series(dtype=int))
    if "calib_seed" not in rows:
        rows = rows.assign(calib_seed=None)
    keys = [c for c in rows.columns if c not in MEASURED and c not in PER_RUN]
    ident = ["\x1f".join(map(_text, values)) for values in rows[keys].itertuples(index=False)]
    out = []
    for _, group in rows.groupby(ident, sort=False):
        seeded = group["calib_seed"].notna()
        if len(group) < 2 or not seeded.all() or group["calib_seed"].nunique() != len(group):
            out += [dict(r, run_ids=(r["run_id"],), seeds=1) for r in group.to_dict("records")]
            continue
        group = group.sort_values("calib_seed", kind="stable")
        first = dict(group.iloc[0])
        for col in MEASURED:
            if col in group:
                values = pd.to_numeric(group[col], errors="coerce")
                first[col] = float(values.mean()) if values.notna().any() else first[col]
        first["run_ids"] = tuple(group["run_id"])
        first["seeds"] = len(group)
        first["calib_seed"] = ",".join(str(_int(s)) for s in group["calib_seed"])
        out.append(first)
    return pd.DataFrame(out, columns=[*rows.columns, "run_ids", "seeds"])


def _text(value) -> str:
    return "" if value is None or (isinstance(value, float) and value != value) or value is pd.NA else str(value)


def _int(value):
    try:
        f = float(value)
    except (TypeError, ValueError):
        return value
    return int(f) if f.is_integer() else f
