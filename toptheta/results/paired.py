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
passkey samples (`id`, `correct`). numpy, scipy's binomial test; no Hydra.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
from scipy.stats import binomtest

from ..store.samples import read_samples, samples_path

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0


_STANDARD_NORMAL = NormalDist()  # z quantiles of normal intervals: _STANDARD_NORMAL.inv_cdf(0.975) = 1.96


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
    """P(X ≤ k or X ≥ n − k) for X ~ Binomial(n, 1/2) (1 when n = 0): scipy's exact binomial test."""
    return 1.0 if n == 0 else float(binomtest(k, n, 0.5).pvalue)


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
    z = _STANDARD_NORMAL.inv_cdf(1 - (1 - level) / 2)
    se = math.sqrt((se_a or 0.0) ** 2 + (se_b or 0.0) ** 2)
    diff = mean_a - mean_b
    return PairedDifference(n=0, mean_a=mean_a, mean_b=mean_b, diff=diff, ci_low=diff - z * se, ci_high=diff + z * se,
                            p_mcnemar=None, level=level, method="independent stderrs")


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

    path = samples_path(run_dir)
    if path is None:
        return {}
    stat = path.stat()
    return dict(_read_outcomes(str(path.resolve()), stat.st_mtime_ns, stat.st_size, task, metric))


@functools.lru_cache(maxsize=256)
def _read_outcomes(path: str, mtime_ns: int, size: int, task: str, metric: str) -> tuple[tuple[Any, float], ...]:
    """Cached by the file's identity: a verdict pass compares each run with many others."""

    return tuple(question_outcomes(read_samples(path), task, metric).items())


@dataclass(frozen=True)
class PairedOutcomes:
    """One pair's per-question differences a − b on the questions both runs scored.

    `universe` names the question set (the task): pairs on one universe share questions, so their
    differences are correlated and must be resampled together (`pooled_bootstrap`). A side measured with
    several calibration seeds (one run per `calib_seed`) carries its per-seed outcomes, (S, n), in
    `a_seeds` / `b_seeds`; `d` is then the difference of the seed means, and the bootstrap draws the seeds
    with replacement as well as the questions (a two-stage bootstrap), so the interval holds the variance of
    the calibration draw.
    """

    universe: str
    ids: tuple[Any, ...]
    d: np.ndarray
    a_seeds: np.ndarray | None = None  # (S_a, n): a's outcomes, one row per calibration seed
    b_seeds: np.ndarray | None = None  # (S_b, n)

    @property
    def diff(self) -> float:
        return float(self.d.mean())

    @property
    def seeded(self) -> bool:
        return self.a_seeds is not None or self.b_seeds is not None

    def sides(self) -> tuple[np.ndarray, np.ndarray]:
        """(A, B): each side's outcomes per seed, (S, n); a side without seeds is one row."""
        a, b = self.a_seeds, self.b_seeds
        if a is None and b is None:
            raise ValueError("sides() is for seeded pairs; an unseeded pair holds only its differences d")
        if a is None:
            a = (self.d + b.mean(0))[None, :]
        if b is None:
            b = (a.mean(0) - self.d)[None, :]
        return a, b

    @property
    def binary(self) -> bool:
        """Whether the outcomes are 0/1 (the rule-of-three floor applies)."""
        if self.seeded:
            return all(_binary(x) for x in self.sides())
        return _binary(np.abs(self.d))


def seeded_outcomes(universe: str, a_runs: Sequence[Mapping[Any, float]], b_runs: Sequence[Mapping[Any, float]]
                    ) -> PairedOutcomes | None:
    """A pair whose sides are measured by one or more runs each (one per calibration seed), on the questions every
    run scored; None when they share none. With one run a side, the plain pair (no seed arrays)."""
    runs = [*a_runs, *b_runs]
    if not runs or not a_runs or not b_runs:
        return None
    common = [q for q in runs[0] if all(q in r for r in runs[1:])]
    if not common:
        return None
    a = np.array([[r[q] for q in common] for r in a_runs], dtype=float)  # (S_a, n)
    b = np.array([[r[q] for q in common] for r in b_runs], dtype=float)  # (S_b, n)
    d = a.mean(0) - b.mean(0)
    return PairedOutcomes(universe, tuple(common), d, a if len(a) > 1 else None, b if len(b) > 1 else None)


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


def se_of(d: PairedDifference) -> float:
    """The standard error behind a normal interval."""
    return (d.ci_high - d.ci_low) / (2 * _STANDARD_NORMAL.inv_cdf(1 - (1 - d.level) / 2))


def rule_of_three(level: float, n: int) -> float:
    """The least half-width an interval on n 0/1 outcomes keeps: no event among n ⇒ rate < −ln(1 − level)/n."""
    return -math.log(1 - level) / n

