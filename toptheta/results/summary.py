"""summary.csv read back for the analysis: one row per (run, task, metric), as a DataFrame.

The store (toptheta.store) writes the file; everything in toptheta.results starts from load_summary.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from ..store.rows import SUMMARY_COLUMNS

# Text columns pinned to str: a hex run id such as "1234e567..." would otherwise parse as a float.
TEXT_COLUMNS = ("run_id", "model", "sparsifier", "placement", "comp", "granularity", "layer_k", "calib_task",
                "calib_statistic", "tac", "calib_compensation", "empty_rows", "calib_beyond", "head_weights", "task",
                "fewshot_sampler", "metric", "stats_scope", "git_commit", "phase", "timestamp")


def load_summary(results_dir: str | os.PathLike[str] = "results") -> pd.DataFrame:
    """summary.csv as a DataFrame (empty, with SUMMARY_COLUMNS, when there is none yet)."""
    path = Path(results_dir) / "summary.csv"
    if not path.exists():
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    summary = pd.read_csv(path, dtype={c: str for c in TEXT_COLUMNS})
    for column in SUMMARY_COLUMNS:  # a store written before a column existed: the column, empty
        if column not in summary:
            summary[column] = None
    return summary
