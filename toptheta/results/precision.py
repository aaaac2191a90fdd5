"""Bootstrap bounds precise enough to decide on: resample more until a decisive bound's Monte Carlo error is small.

A percentile bound from B resamples moves by its Monte Carlo error (pooled.mc_error) when the bootstrap is rerun
with another seed; at 10,000 resamples and a Bonferroni level (a tail of ~12 resamples) that error can carry a
knife-edge verdict across the margin. `precise` reruns the bootstrap with 4× the resamples (same seed) until every
bound the verdict depends on has a Monte Carlo error of at most PRECISION (0.001), or MAX_RESAMPLES is reached.

A bound is one the verdict depends on when it lies within DECISIVE Monte Carlo errors of the decision boundary
(0 for superiority, −margin for non-inferiority): farther away, rerunning the bootstrap cannot move it across.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .paired import DEFAULT_RESAMPLES, PairedDifference, PairedOutcomes
from .pooled import pooled_draws

PRECISION = 0.001
DECISIVE = 4.0  # Monte Carlo errors: a bound farther than this from the boundary cannot flip the verdict
MAX_RESAMPLES = 640_000
GROWTH = 4


@dataclass(frozen=True)
class Interval:
    """A pooled effect, its interval at `level`, each bound's Monte Carlo error and the resamples behind them."""

    effect: float
    low: float
    high: float
    mc_low: float
    mc_high: float
    resamples: int
    level: float

    @property
    def precise(self) -> bool:
        return max(self.mc_low, self.mc_high) <= PRECISION


def decisive(bound: float, error: float, boundary: float) -> bool:
    """Whether rerunning the bootstrap could move `bound` across `boundary` (and its error is above PRECISION)."""
    return error > PRECISION and abs(bound - boundary) <= DECISIVE * error


def precise(pairs: Sequence[PairedOutcomes | PairedDifference], *, levels: Sequence[float], boundary: float,
            resamples: int = DEFAULT_RESAMPLES, max_resamples: int = MAX_RESAMPLES) -> list[Interval]:
    """The pooled effect's interval at each level, with Monte Carlo errors, from enough resamples that no bound
    within DECISIVE errors of `boundary` keeps an error above PRECISION (or max_resamples were drawn)."""
    while True:
        draws = pooled_draws(pairs, resamples=resamples)
        out = []
        for level in levels:
            low, high = draws.interval(level)
            mc_low, mc_high = draws.mc_errors(level)
            out.append(Interval(draws.point, low, high, mc_low, mc_high, resamples, level))
        open_bounds = any(decisive(i.low, i.mc_low, boundary) or decisive(i.high, i.mc_high, boundary) for i in out)
        if not open_bounds or resamples * GROWTH > max_resamples:
            return out
        resamples *= GROWTH
