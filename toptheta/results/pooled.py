"""The pooled paired bootstrap: one claim's pairs, shared questions and calibration seeds resampled together.

A claim pools many pairs (paired.PairedOutcomes) that reuse questions (one dense run against every k; one task
across models), so their differences are not independent and an independent pool would be too narrow. Each
resample draws the questions of every universe once and applies the same draw to all pairs on that universe; a
side measured with several calibration seeds also has its seeds drawn with replacement (two-stage bootstrap).

Every percentile bound comes with its Monte Carlo error (`mc_error`): the spread of the order statistics around
the bound's rank, ±1 binomial standard deviation of the count of resamples below it (distribution-free; about
sqrt(α(1 − α)/B) / density). precision.py resamples more where a verdict depends on a bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .paired import DEFAULT_RESAMPLES, DEFAULT_SEED, PairedDifference, PairedOutcomes, rule_of_three, se_of


def pooled_bootstrap(pairs: Sequence[PairedOutcomes | PairedDifference], *, resamples: int = DEFAULT_RESAMPLES,
                     level: float = 0.95, seed: int = DEFAULT_SEED) -> tuple[float, float, float]:
    """The weighted mean difference over several pairs and its percentile interval, dependence included.

    A pair without per-question outcomes (`PairedDifference` from two stderrs) contributes a normal draw
    around its difference. The pooled effect is the mean of the pair differences weighted by their numbers
    of questions (a two-stderr pair counts as 0.25/se² questions, the size that gives its stderr to a 0/1
    score at one half), so a 6-prompt pair does not weigh as much as a 500-question one, and a pair that
    happens to agree everywhere does not swamp the rest as it would under inverse-variance weights.

    With no discordant question at all the resampled interval shrinks to a point; for 0/1 scores the rule
    of three (no event among n ⇒ rate < −ln(1 − level)/n, 3/n at 95 %) keeps at least that half-width, n the
    largest 0/1 universe's size. Continuous scores (Rouge) get no floor: 3/n of a 10-document task would
    swamp a Rouge difference of a few hundredths.
    """
    point, ((low, high),) = pooled_intervals(pairs, levels=(level,), resamples=resamples, seed=seed)
    return point, low, high


def pooled_intervals(pairs: Sequence[PairedOutcomes | PairedDifference], *, levels: Sequence[float],
                     resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED
                     ) -> tuple[float, list[tuple[float, float]]]:
    """pooled_bootstrap's effect and its interval at each of `levels`, from one set of resamples."""
    draws = pooled_draws(pairs, resamples=resamples, seed=seed)
    return draws.point, [draws.interval(level) for level in levels]


class Draws:
    """The resampled pooled effects of one set of pairs: the point estimate, its percentile bounds and their
    Monte Carlo errors."""

    def __init__(self, point: float, means: np.ndarray, floor_n: int | None):
        self.point, self.floor_n = point, floor_n
        self.sorted = np.sort(means)
        self.resamples = len(means)

    def _quantile(self, q: float) -> float:
        return float(np.quantile(self.sorted, q))

    def interval(self, level: float) -> tuple[float, float]:
        """The percentile interval, widened to the rule-of-three half-width for 0/1 scores."""
        alpha = (1.0 - level) / 2
        low, high = self._quantile(alpha), self._quantile(1 - alpha)
        if self.floor_n:
            half = rule_of_three(level, self.floor_n)
            low, high = min(low, self.point - half), max(high, self.point + half)
        return low, high

    def mc_errors(self, level: float) -> tuple[float, float]:
        """The Monte Carlo error of each bound of interval(level); 0 for a bound the rule of three sets."""
        alpha = (1.0 - level) / 2
        low, high = self.interval(level)
        out = []
        for q, bound in ((alpha, low), (1 - alpha, high)):
            if bound != self._quantile(q):  # set by the floor: no resampling noise in it
                out.append(0.0)
                continue
            out.append(mc_error(self.sorted, q))
        return out[0], out[1]


def mc_error(sorted_means: np.ndarray, q: float) -> float:
    """The Monte Carlo standard error of the q-quantile of B sorted resamples: half the distance between the
    order statistics one binomial standard deviation, sqrt(B q (1 − q)), either side of its rank."""
    b = len(sorted_means)
    spread = math.sqrt(b * q * (1 - q))
    lo = min(b - 1, max(0, math.floor(q * (b - 1) - spread)))
    hi = min(b - 1, max(0, math.ceil(q * (b - 1) + spread)))
    return float(sorted_means[hi] - sorted_means[lo]) / 2


def pooled_draws(pairs: Sequence[PairedOutcomes | PairedDifference], *, resamples: int = DEFAULT_RESAMPLES,
                 seed: int = DEFAULT_SEED) -> Draws:
    """`resamples` pooled effects (see pooled_bootstrap), from a numpy Generator seeded with `seed`."""
    if not pairs:
        raise ValueError("pooled_bootstrap needs at least one pair")
    rng = np.random.default_rng(seed)
    universes: dict[str, list[Any]] = {}
    for p in pairs:
        if isinstance(p, PairedOutcomes):
            known = universes.setdefault(p.universe, [])
            seen = set(known)
            known.extend(q for q in p.ids if q not in seen and not seen.add(q))
    index = {u: {q: i for i, q in enumerate(ids)} for u, ids in universes.items()}
    weights = np.array([len(p.ids) if isinstance(p, PairedOutcomes) else 0.25 / max(se_of(p), 1e-6) ** 2
                        for p in pairs])
    weights = weights / weights.sum()
    point = float(weights @ np.array([p.diff for p in pairs]))
    # A pair on all of its universe's questions is a weighted mean over the drawn questions, so all such pairs of
    # a universe add up to one product with Σ weight·d; a pair on some of them, or with seeds, needs its own.
    whole = {u: np.zeros(len(ids)) for u, ids in universes.items()}
    some = []
    for p, weight in zip(pairs, weights):
        if not isinstance(p, PairedOutcomes):
            continue
        pos = np.array([index[p.universe][q] for q in p.ids])
        if len(pos) == len(universes[p.universe]) and not p.seeded:
            whole[p.universe][pos] += weight * p.d
        else:
            some.append((p, pos, weight, p.sides() if p.seeded else None))
    unpaired = [(p, weight) for p, weight in zip(pairs, weights) if not isinstance(p, PairedOutcomes)]
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):
        size = min(1000, resamples - start)
        total = np.zeros(size)
        for u, ids in universes.items():
            n = len(ids)
            drawn = rng.integers(0, n, size=(size, n)) + n * np.arange(size)[:, None]
            counts = np.bincount(drawn.ravel(), minlength=size * n).reshape(size, n).astype(float)
            total += counts @ whole[u] / n
            for p, pos, weight, sides in (x for x in some if x[0].universe == u):
                w = counts[:, pos]  # (size, m): how often each of the pair's questions was drawn
                den = np.maximum(w.sum(1), 1)
                if sides is None:
                    total += weight * np.where(w.sum(1) > 0, (w @ p.d) / den, p.diff)
                    continue
                side_means = []
                for outcomes in sides:  # (S, m): per seed, the mean over the drawn questions
                    per_seed = (w @ outcomes.T) / den[:, None]  # (size, S)
                    s = len(outcomes)
                    chosen = rng.multinomial(s, np.full(s, 1.0 / s), size=size) / s  # (size, S) seeds drawn
                    side_means.append((per_seed * chosen).sum(1))
                total += weight * (side_means[0] - side_means[1])
        for p, weight in unpaired:
            total += weight * rng.normal(p.diff, se_of(p), size=size)
        means[start:start + size] = total
    binary = [len(ids) for u, ids in universes.items()
              if all(p.binary for p in pairs if isinstance(p, PairedOutcomes) and p.universe == u)]
    return Draws(point, means, max(binary) if binary else None)
