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

from collections.abc import Mapping
from typing import Any

import pandas as pd

LONG_ROW_SHOTS = 10  # HellaSwag's 10 shots, the shorter of the paper's two long-row QA protocols


def _number(value) -> float:
    """A summary cell as a number; 0 for empty, NaN or text."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if number != number else number


def long_row(run: Mapping[str, Any]) -> bool:
    """Whether a summary row is a run of the long-row protocol (many fixed exemplars)."""
    return _number(run.get("num_fewshot")) >= LONG_ROW_SHOTS and str(run.get("fewshot_sampler")) == "first_n"


def broke_protocol(run: Mapping[str, Any]) -> bool:
    """A long-row run with rows past its calibrated length."""
    return long_row(run) and _number(run.get("clamped_rows")) > 0


def split(summary: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(long-row runs, long-row runs that broke the protocol (clamped rows), the rest) of a summary table."""
    runs = summary.to_dict("records")
    long_rows = pd.Series([long_row(r) for r in runs], index=summary.index, dtype=bool)
    broken = pd.Series([broke_protocol(r) for r in runs], index=summary.index, dtype=bool)
    return summary[long_rows & ~broken], summary[broken], summary[~long_rows]
