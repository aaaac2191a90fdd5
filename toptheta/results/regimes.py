"""Which protocol a stored run belongs to: the paper's regime (long rows at matched sparsity) or the earlier short rows.

The paper's QA claims are about rows of about a thousand keys (ARC at 25 shots, HellaSwag at 10) compared at equal
sparsity. Runs with at least LONG_ROW_SHOTS fixed exemplars (``fewshot_sampler=first_n``, the long-row protocol of
``experiments/long_rows``) are that regime, their dense baselines included; every other run (zero-shot, 5-shot,
random exemplars, generation tasks) belongs to the earlier protocols. results/README.md leads with the first and
reports the second in a section of its own (scripts/verdicts.py); the verdicts are computed on each part alone, so a
claim's pooled interval never mixes the two. A long-row run with rows past its calibrated length (``clamped_rows`` > 0)
broke the protocol (its thresholds did not cover the rows it met) and is left out of the verdicts, listed apart.
"""

from __future__ import annotations

import pandas as pd

LONG_ROW_SHOTS = 10  # HellaSwag's 10 shots, the shorter of the paper's two long-row QA protocols


def is_long_row(summary: pd.DataFrame) -> pd.Series:
    """Per summary row: whether it is a run of the long-row protocol (many fixed exemplars)."""
    shots = pd.to_numeric(summary["num_fewshot"], errors="coerce").fillna(0)
    sampler = summary["fewshot_sampler"].fillna("").astype(str) if "fewshot_sampler" in summary else ""
    return (shots >= LONG_ROW_SHOTS) & (sampler == "first_n")


def split(summary: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(long-row runs, long-row runs that broke the protocol (clamped rows), the rest) of a summary table."""
    long_rows = is_long_row(summary)
    clamped = (pd.to_numeric(summary["clamped_rows"], errors="coerce").fillna(0) > 0 if "clamped_rows" in summary
               else pd.Series(False, index=summary.index))
    return summary[long_rows & ~clamped], summary[long_rows & clamped], summary[~long_rows]
