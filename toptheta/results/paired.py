"""Paired statistics: a sparse run against the dense baseline on the same questions.

Two runs of one task score the same documents, so the accuracy difference is estimated from the
per-question differences d_i = sparse_i - dense_i. Their spread is far smaller than two independent
stderrs when both runs get most questions right or wrong together, which is the case for a sparse
model that tracks the dense one.

* `paired_bootstrap`: the percentile confidence interval of mean(d) from resampling questions with
  replacement (numpy Generator seeded, so a rerun gives the same interval).
* `mcnemar`: the exact two-sided McNemar p-value for 0/1 outcomes: under "no difference" each of the
  n discordant questions (right in one run only) is right in the sparse run with probability 1/2.

Per-question outcomes come from a run directory's samples.json.gz (`question_outcomes`): lm-eval's
per-sample logs (`{task: [{doc_id, acc_norm, ...}]}`), our HumanEval samples (`task_id`, `passed`) or
passkey samples (`id`, `correct`). Plain numpy; no scipy, no Hydra.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0


@dataclass(frozen=True)
class PairedDifference:
    """mean(a − b) over n common questions, its confidence interval and the McNemar p-value (0/1 data)."""

    n: int
    mean_a: float
    mean_b: float
    diff: float
    ci_low: float
    ci_high: float
    p_mcnemar: float | None
    a_only: int | None = None  # questions right in a and wrong in b (0/1 data)
    b_only: int | None = None
    level: float = 0.95
    method: str = "paired bootstrap"

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _binary(x: np.ndarray) -> bool:
    return bool(np.isin(x, (0.0, 1.0)).all())


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES,
                     level: float = 0.95, seed: int = DEFAULT_SEED) -> tuple[float, float]:
    """Percentile CI of mean(a − b), resampling the question indices (the same indices for a and b)."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.ndim != 1 or len(d) == 0 or len(a) != len(b):
        raise ValueError(f"need two equally long, non-empty sequences of per-question scores; got {len(a)} and {len(b)}")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # chunks keep memory at 1000 × n
        idx = rng.integers(0, len(d), size=(min(1000, resamples - start), len(d)))
        means[start:start + len(idx)] = d[idx].mean(1)
    alpha = (1.0 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def mcnemar(a: Sequence[float], b: Sequence[float]) -> tuple[float, int, int]:
    """Exact two-sided McNemar test of paired 0/1 outcomes: (p-value, a right only, b right only)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not (_binary(x) and _binary(y)):
        raise ValueError("McNemar's test needs 0/1 outcomes (accuracy, pass@1); use paired_bootstrap for scores")
    a_only, b_only = int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    return binomial_two_sided(min(a_only, b_only), a_only + b_only), a_only, b_only


def binomial_two_sided(k: int, n: int) -> float:
    """P(X ≤ k or X ≥ n − k) for X ~ Binomial(n, 1/2) with k ≤ n/2 (1 when n = 0), computed exactly."""
    if n == 0:
        return 1.0
    k = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def compare(a: Sequence[float], b: Sequence[float], *, resamples: int = DEFAULT_RESAMPLES, level: float = 0.95,
            seed: int = DEFAULT_SEED) -> PairedDifference:
    """Everything about a − b on paired questions: means, difference, bootstrap CI, McNemar for 0/1 data."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    low, high = paired_bootstrap(x, y, resamples=resamples, level=level, seed=seed)
    p, a_only, b_only = (None, None, None)
    if _binary(x) and _binary(y):
        p, a_only, b_only = mcnemar(x, y)
    return PairedDifference(n=len(x), mean_a=float(x.mean()), mean_b=float(y.mean()), diff=float((x - y).mean()),
                            ci_low=low, ci_high=high, p_mcnemar=p, a_only=a_only, b_only=b_only, level=level)


def unpaired(mean_a: float, se_a: float, mean_b: float, se_b: float, *, level: float = 0.95) -> PairedDifference:
    """Fallback without per-question outcomes: a normal CI from two independent stderrs (wider, conservative)."""
    z = _normal_quantile(1 - (1 - level) / 2)
    se = math.sqrt((se_a or 0.0) ** 2 + (se_b or 0.0) ** 2)
    diff = mean_a - mean_b
    return PairedDifference(n=0, mean_a=mean_a, mean_b=mean_b, diff=diff, ci_low=diff - z * se, ci_high=diff + z * se,
                            p_mcnemar=None, level=level, method="independent stderrs")


def _normal_quantile(p: float) -> float:
    """Inverse standard normal CDF by bisection on erf (accurate to 1e-10; no scipy)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------- per-question outcomes from a run directory

_ID_KEYS = ("doc_id", "task_id", "id")
_OUTCOME_KEYS = {"pass@1": ("passed",), "accuracy": ("correct",)}


def question_outcomes(samples: Any, task: str, metric: str) -> dict[Any, float]:
    """{question id: score} for one task and metric (e.g. 'acc_norm,none') from a samples file's content.

    lm-eval's samples are {task: [sample, ...]} with the metric's per-sample value under its bare name;
    our generation tasks store a list of samples (HumanEval: task_id/passed, passkey: id/correct, ruler: id/score).
    """
    name = metric.split(",")[0]
    records = samples.get(task) if isinstance(samples, Mapping) else samples
    if records is None:
        return {}
    length = re.fullmatch(r"passkey_(\d+)", task)
    if length and not isinstance(samples, Mapping):  # one passkey length: its prompts only
        records = [r for r in records if str(r.get("id", "")).startswith(f"passkey-{length.group(1)}-")]
    view = re.fullmatch(r"ruler(?:_(\d+))?(?:_([a-z][a-z_]*))?", task)
    if view and not isinstance(samples, Mapping):  # a ruler view (length, sub-task or both): its prompts only
        pattern = re.compile(rf"ruler-{view.group(1) or '[0-9]+'}-{view.group(2) or '[a-z_]+'}-[0-9]+-[0-9]+")
        records = [r for r in records if pattern.fullmatch(str(r.get("id", "")))]
    out = {}
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            continue
        qid = next((record[k] for k in _ID_KEYS if k in record), i)
        value = record.get(name)
        if value is None:
            value = next((record[k] for k in _OUTCOME_KEYS.get(name, ()) if k in record), None)
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if isinstance(value, (bool, int, float)):
            out[qid] = float(value)
    return out


def read_outcomes(run_dir: str | Path, task: str, metric: str) -> dict[Any, float]:
    """question_outcomes of one run directory ({} when it kept no per-sample outputs)."""
    from .store import samples_path

    path = samples_path(run_dir)
    if path is None:
        return {}
    stat = path.stat()
    return dict(_read_outcomes(str(path.resolve()), stat.st_mtime_ns, stat.st_size, task, metric))


@functools.lru_cache(maxsize=256)
def _read_outcomes(path: str, mtime_ns: int, size: int, task: str, metric: str) -> tuple[tuple[Any, float], ...]:
    """Cached by the file's identity: a verdict pass compares each run with many others."""
    from .store import read_samples

    return tuple(question_outcomes(read_samples(path), task, metric).items())


@dataclass(frozen=True)
class PairedOutcomes:
    """One pair's per-question differences a − b on the questions both runs scored.

    `universe` names the question set (the task): pairs on one universe share questions, so their
    differences are correlated and must be resampled together (`pooled_bootstrap`).
    """

    universe: str
    ids: tuple[Any, ...]
    d: np.ndarray

    @property
    def diff(self) -> float:
        return float(self.d.mean())


def paired_outcomes(run_a: str | Path, run_b: str | Path, task: str, metric: str) -> PairedOutcomes | None:
    """The per-question differences of two run directories; None when either kept no per-sample outputs."""
    a, b = read_outcomes(run_a, task, metric), read_outcomes(run_b, task, metric)
    common = [q for q in a if q in b]
    if not common:
        return None
    return PairedOutcomes(task, tuple(common), np.array([a[q] - b[q] for q in common], dtype=float))


def compare_runs(run_a: str | Path, run_b: str | Path, task: str, metric: str, **kwargs) -> PairedDifference | None:
    """Paired comparison of two run directories on their common questions; None without per-sample outputs."""
    a, b = read_outcomes(run_a, task, metric), read_outcomes(run_b, task, metric)
    common = [q for q in a if q in b]
    if not common:
        return None
    return compare([a[q] for q in common], [b[q] for q in common], **kwargs)


def _se_of(d: PairedDifference) -> float:
    """The standard error behind a normal interval."""
    return (d.ci_high - d.ci_low) / (2 * _normal_quantile(1 - (1 - d.level) / 2))


def rule_of_three(level: float, n: int) -> float:
    """The least half-width an interval on n 0/1 outcomes keeps: no event among n ⇒ rate < −ln(1 − level)/n."""
    return -math.log(1 - level) / n


def pooled_bootstrap(pairs: Sequence[PairedOutcomes | PairedDifference], *, resamples: int = DEFAULT_RESAMPLES,
                     level: float = 0.95, seed: int = DEFAULT_SEED) -> tuple[float, float, float]:
    """The weighted mean difference over several pairs and its percentile interval, dependence included.

    Pairs of a claim reuse questions (one dense run against every k; one task across models), so their
    differences are not independent and an independent pool would be too narrow. Each resample
    draws the questions of every universe once (how often each is drawn) and applies the same draw to all
    pairs on that universe; a pair without per-question outcomes (`PairedDifference` from two stderrs)
    contributes a normal draw around its difference. The pooled effect is the mean of the pair
    differences weighted by their numbers of questions (a two-stderr pair counts as 0.25/se² questions,
    the size that gives its stderr to a 0/1 score at one half), so a 6-prompt pair does not weigh as
    much as a 500-question one, and a pair that happens to agree everywhere does not swamp the rest as
    it would under inverse-variance weights.

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
    weights = np.array([len(p.ids) if isinstance(p, PairedOutcomes) else 0.25 / max(_se_of(p), 1e-6) ** 2
                        for p in pairs])
    weights = weights / weights.sum()
    point = float(weights @ np.array([p.diff for p in pairs]))
    # A pair on all of its universe's questions is a weighted mean over the drawn questions, so all such pairs of
    # a universe add up to one product with Σ weight·d; a pair on some of them needs its own.
    whole = {u: np.zeros(len(ids)) for u, ids in universes.items()}
    some = []
    for p, weight in zip(pairs, weights):
        if not isinstance(p, PairedOutcomes):
            continue
        pos = np.array([index[p.universe][q] for q in p.ids])
        if len(pos) == len(universes[p.universe]):
            whole[p.universe][pos] += weight * p.d
        else:
            some.append((p, pos, weight))
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
            for p, pos, weight in (x for x in some if x[0].universe == u):
                w = counts[:, pos]
                den = w.sum(1)
                total += weight * np.where(den > 0, (w @ p.d) / np.maximum(den, 1), p.diff)
        for p, weight in unpaired:
            total += weight * rng.normal(p.diff, _se_of(p), size=size)
        means[start:start + size] = total
    binary = [len(ids) for u, ids in universes.items()
              if all(_binary(np.abs(p.d)) for p in pairs if isinstance(p, PairedOutcomes) and p.universe == u)]
    intervals = []
    for level in levels:
        alpha = (1.0 - level) / 2
        low, high = float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))
        if binary:  # 0/1 scores only: a continuous score (Rouge) gives the bootstrap its spread by itself
            half = rule_of_three(level, max(binary))
            low, high = min(low, point - half), max(high, point + half)
        intervals.append((low, high))
    return point, intervals
