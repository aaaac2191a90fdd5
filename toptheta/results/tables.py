"""Tables from the results store (summary.csv), for the terminal, notebooks and the paper scripts."""

from __future__ import annotations

import pandas as pd

COLUMNS = ["sparsifier", "placement", "k", "comp", "task", "metric", "value", "stderr",
           "kept_attention_fraction", "kept_vrow_fraction"]


def comparison_table(summary: pd.DataFrame, run_ids: list[str], metric: str | None = None) -> pd.DataFrame:
    """The rows of ``run_ids`` (their latest entries), one line per run and metric, compactly rounded."""
    if summary.empty:
        return pd.DataFrame(columns=COLUMNS)
    rows = summary[summary["run_id"].isin(run_ids)]
    rows = rows.drop_duplicates(subset=["run_id", "task", "metric"], keep="last")
    if metric is not None:
        rows = rows[rows["metric"] == metric]
    order = {run_id: i for i, run_id in enumerate(run_ids)}
    rows = rows.sort_values(by="run_id", key=lambda s: s.map(order), kind="stable")
    table = rows[[c for c in COLUMNS if c in rows.columns]].copy()
    for col in ("value", "stderr", "kept_attention_fraction", "kept_vrow_fraction"):
        if col in table:
            table[col] = pd.to_numeric(table[col], errors="coerce").round(4)
    return table.reset_index(drop=True)
