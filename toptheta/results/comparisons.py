"""The store as comparable rows, and the pairs of runs a claim compares.

Every run of every trade-off group becomes one row (store_rows: its group, series and settings, runs of one
configuration calibrated with several seeds merged, seeds.py). A pair is two rows of one group that differ in
the respect a claim is about and agree on the columns it names (pairs); its difference comes with a 95 %
interval, paired per question where both runs kept samples (compare_rows). A configuration measured on more
questions of the same setting supersedes its smaller samples (sample_sizes, superseded_runs, pair_superseded),
so no question weighs twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from . import figures, labels, paired, pooled, seeds, selection

LEVEL = 0.95  # every pair's interval, and the claims' (verdicts.py)
MARGIN = 0.01  # the non-inferiority margin of every claim (verdicts.decide)
MATCHED_SLACK = 0.10  # how far the evaluated rows of a run matched to a target may land from it (target_kept.py)
TARGET_MEASURES = {"attention": "kept_attention_fraction", "vrows": "kept_vrow_fraction"}  # sparsifier.target_measure


@dataclass
class Verdict:
    """A claim's verdict: its pairs, pooled effect and interval, and per-setting detail (verdicts.py decides it)."""

    claim: str
    kind: str  # superiority | non-inferiority
    pairs: list[dict[str, Any]] = field(default_factory=list)
    effect: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str = "undecided"
    note: str = ""
    settings: list[dict[str, Any]] = field(default_factory=list)  # per_setting(): the claim in each setting
    uninformative: list[dict[str, Any]] = field(default_factory=list)  # per_setting() of the excluded settings
    mc_low: float | None = None  # the Monte Carlo error of each bound (precision.py)
    mc_high: float | None = None
    resamples: int | None = None
    table: pd.DataFrame | None = None  # claim 6: its reduction table (reduction.py), informative settings only

    def as_row(self) -> dict[str, Any]:
        ci = "" if self.ci_low is None else f"[{self.ci_low:+.3f}, {self.ci_high:+.3f}]"
        effect = "" if self.effect is None else f"{self.effect:+.3f}"
        mc = ", ".join("" if e is None or pd.isna(e) else f"{e:.4f}" for e in (self.mc_low, self.mc_high))
        mc = "" if mc == ", " else mc
        return {"claim": self.claim, "effect": effect, "95% CI": ci, "MC error of the bounds": mc,
                "resamples": "" if self.resamples is None else f"{self.resamples:,}", "pairs": len(self.pairs),
                "verdict": self.verdict if self.pairs else "undecided (no runs yet)", "note": self.note}


def usable(d: paired.PairedDifference) -> bool:
    """A comparison from two stderrs of 0 (all right or all wrong, no per-question data) says nothing."""
    return d.n > 0 or d.ci_high > d.ci_low


def store_rows(summary: pd.DataFrame) -> pd.DataFrame:
    """Every run of every trade-off group with its group keys, series (labels.series_label) and settings."""
    frames = []
    for group in selection.tradeoff_groups(summary):
        if re.fullmatch(r"passkey_\d+|ruler_\w+", str(group["task"])):
            continue  # per-length (ruler: and per-sub-task) views of a run: its questions already count under the task
        table = figures.tradeoff_table(summary, **group)
        frames.append(table.assign(group=selection.group_title(**group), **{f"g_{k}": v for k, v in group.items()}))
    if not frames:
        return pd.DataFrame()
    rows = seeds.merge_seeds(pd.concat(frames, ignore_index=True))
    rows["level"] = [f"target {as_text(t)}" if as_text(t) else f"k {as_text(k)}" for t, k in zip(rows["target_kept"], rows["k"])]
    return rows


def compare_rows(a: pd.Series, b: pd.Series, results_dir: Path | None, level: float = LEVEL):
    """(a − b with its interval, the pair's data for pooling): per question when both runs kept samples; a side
    measured with several calibration seeds (run_ids) resamples its seeds too."""
    if results_dir is not None:
        runs = results_dir / "runs"
        a_runs, b_runs = ([paired.read_outcomes(runs / r, a["task"], a["metric"]) for r in run_ids(x)] for x in (a, b))
        outcomes = paired.seeded_outcomes(a["task"], a_runs, b_runs) if all(a_runs) and all(b_runs) else None
        if outcomes is not None and not outcomes.seeded:
            d = paired.compare_runs(runs / a["run_id"], runs / b["run_id"], a["task"], a["metric"], level=level)
            return d, outcomes
        if outcomes is not None:
            point, low, high = pooled.pooled_bootstrap([outcomes], level=level)
            seeds_note = f"{len(run_ids(a))} × {len(run_ids(b))} calibration seeds"
            return paired.PairedDifference(n=len(outcomes.ids), mean_a=float(outcomes.sides()[0].mean()),
                                           mean_b=float(outcomes.sides()[1].mean()), diff=point, ci_low=low,
                                           ci_high=high, p_mcnemar=None, level=level,
                                           method=f"paired bootstrap over questions and {seeds_note}"), outcomes
    d = paired.unpaired(float(a["value"]), _se(a), float(b["value"]), _se(b), level=level)
    return d, d


def run_ids(row: pd.Series) -> tuple[str, ...]:
    ids = row.get("run_ids")
    return tuple(ids) if isinstance(ids, tuple) else (row["run_id"],)


def _se(row: pd.Series) -> float:
    return 0.0 if pd.isna(row["stderr"]) else float(row["stderr"])


def _same(a: pd.Series, b: pd.Series, columns: Sequence[str]) -> bool:
    return all(as_text(a.get(c)) == as_text(b.get(c)) for c in columns)


def as_text(value: Any) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


CALIBRATION = ("calib_task", "calib_statistic", "sigma_add", "tac", "calib_documents", "granularity", "empty_rows",
               "layer_k")
# The in-domain calibration set of a task without a train split: HumanEval's is HumanEval-disjoint Python code.
IN_DOMAIN = {"humaneval": "python_code"}


def self_calibrated(row: pd.Series) -> bool:
    """Whether a run's thresholds were calibrated on its own task (HumanEval's: on IN_DOMAIN code), not transferred
    from another dataset; a run without a calibration task is not."""
    calib = as_text(row["calib_task"])
    return calib != "" and calib in (as_text(row["task"]), IN_DOMAIN.get(as_text(row["task"]), ""))


def target_measure(row) -> str:
    """The column a matched run's target is a fraction of (``sparsifier.target_measure``; attention elements unless
    it says V rows, also for runs stored before the column)."""
    measure = row.get("target_measure")
    return TARGET_MEASURES.get(measure if isinstance(measure, str) and measure else "attention",
                               TARGET_MEASURES["attention"])


def on_target(row) -> bool:
    """Whether a run stands at its matched target: a run given by k always; a run matched to a target kept fraction
    (``target_kept``) when its evaluated rows landed within ±MATCHED_SLACK of it. A run whose fit missed (its
    fitting rows unlike the evaluated ones) is no point of equal sparsity, so it pairs with nothing at the target."""
    target = selection.as_number(row.get("target_kept"))
    if not isinstance(target, (int, float)) or target <= 0:
        return True
    try:
        kept = float(row.get(target_measure(row)))
    except (TypeError, ValueError):
        return False
    return abs(kept / target - 1) <= MATCHED_SLACK


def find_pairs(rows: pd.DataFrame, pick_a, pick_b, match: Sequence[str], results_dir, accept=None,
               sizes: dict[tuple, dict[float, list[pd.Series]]] | None = None) -> list[dict]:
    """Every (a, b) in one group picked by pick_a / pick_b, equal on `match`, both at their target (``on_target``)
    and passing `accept`; with `sizes` (sample_sizes of all rows) a pair whose two configurations also make an
    accepted pair on more questions of the setting is left to that larger sample (the same questions must not
    count twice)."""
    out = []
    for _, group in rows.groupby("group", sort=True):
        for _, a in group[group.apply(pick_a, axis=1)].iterrows():
            if not on_target(a):
                continue
            for _, b in group[group.apply(pick_b, axis=1)].iterrows():
                if a["run_id"] == b["run_id"] or not _same(a, b, match) or not on_target(b) \
                        or (accept and not accept(a, b)):
                    continue
                if sizes is not None and pair_superseded(a, b, sizes, accept):
                    continue
                d, data = compare_rows(a, b, results_dir)
                if not usable(d):
                    continue
                out.append({"group": a["group"], "a": a["series"], "b": b["series"], "k": selection.as_number(a["k"]),
                            "diff": d.diff, "ci_low": d.ci_low, "ci_high": d.ci_high, "method": d.method,
                            "_d": data})
    return out


def pick(sparsifier: str, placement: str | None = None, comp: str | None = None):
    """A row filter for find_pairs: runs of the paper's series with this sparsifier (placement, compensation)."""
    def chosen(row: pd.Series) -> bool:
        return (row["sparsifier"] == sparsifier and (placement is None or row["placement"] == placement)
                and (comp is None or as_text(row["comp"]) == comp) and labels.main_series(str(row["series"])))
    return chosen


FAMILY = ["g_model", "g_task", "g_num_fewshot", "g_metric"]  # a setting up to its number of questions
CONFIGURATION = ["series", "k", "target_kept", "fewshot_sampler", "calib_seed", *CALIBRATION]  # what a run computes, whatever it is evaluated on


def _size(row: pd.Series) -> float:
    """The number of questions a run's group evaluates, as an order: its limit, or ∞ for the whole split."""
    limit = selection.as_number(row["g_limit"])
    return math.inf if limit is None else float(limit)


def _configuration(row: pd.Series) -> tuple:
    """(setting, configuration): what a run computes and where, whatever number of questions it saw."""
    return tuple(as_text(row.get(c)) for c in FAMILY), tuple(as_text(row.get(c)) for c in CONFIGURATION)


def sample_sizes(rows: pd.DataFrame) -> dict[tuple, dict[float, list[pd.Series]]]:
    """_configuration → number of questions (_size) → the runs that measured it on that many."""
    out: dict[tuple, dict[float, list[pd.Series]]] = {}
    for _, row in rows.iterrows():
        out.setdefault(_configuration(row), {}).setdefault(_size(row), []).append(row)
    return out


def superseded_runs(rows: pd.DataFrame) -> set[str]:
    """Runs whose configuration was also measured on more questions of the same setting (a larger limit; none =
    all): a first small run (e.g. 20 problems) decides nothing beside the same configuration at 80."""
    sparse = rows[rows["series"] != "Baseline"]
    sizes = sample_sizes(sparse)
    return {row["run_id"] for _, row in sparse.iterrows() if _size(row) < max(sizes[_configuration(row)])}


def pair_superseded(a: pd.Series, b: pd.Series, sizes: dict[tuple, dict[float, list[pd.Series]]],
                     accept=None) -> bool:
    """Both configurations of a pair were also measured on more questions of the setting, and make a pair there
    that `accept` (if given) takes: the pair speaks from there. (The larger sample usually contains the smaller
    one, e.g. ARC-Easy's first 500 questions and the whole split: pooling both would count those 500 twice.) A
    pair the larger sample rejects (say, kept fractions drifting apart) still speaks from the smaller one."""
    at_a, at_b = sizes.get(_configuration(a), {}), sizes.get(_configuration(b), {})
    return any(n > _size(a) and (accept is None or any(accept(x, y) for x in at_a[n] for y in at_b[n]))
               for n in at_a.keys() & at_b.keys())


def close(x: Any, y: Any, ratio: float = 1.25) -> bool:
    try:
        x, y = float(x), float(y)
    except (TypeError, ValueError):
        return False
    return x > 0 and y > 0 and max(x, y) / min(x, y) <= ratio
