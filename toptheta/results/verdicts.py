"""Verdicts on the paper's claims, from the results store alone.

Each claim compares pairs of runs that differ in one respect and agree on everything else (model, task,
shots, questions, k, calibration). A pair's difference in the task metric comes with a 95 % interval:
paired per question when both runs kept per-sample outputs (paired.py), else from the two stderrs.
A claim's effect is the mean of its pairs' differences weighted by their numbers of questions; its interval
comes from one bootstrap that resamples each task's questions once for all pairs on that task
(`pooled.pooled_bootstrap`: the pairs share questions and baselines, so they are not independent). A pair
whose two configurations were also measured on more questions of the same setting (e.g. ARC-Easy's first
500 and the whole split) speaks from the larger sample only, so no question weighs twice. The interval decides,
with a margin δ of one point (0.01) where the claim is "no worse than":

    superiority  (A beats B)          holds: low > 0       fails: high < 0      else undecided
    non-inferiority (A ≈ B, ≤ δ loss) holds: low > −δ      fails: high < −δ     else undecided

A claim that holds pooled can still fail in one setting (a task, a model): `per_setting` decides each claim in
each setting (group) on its own pairs, at 95 % and Bonferroni-adjusted over the claim's settings, and
`disagreements` names the settings and the single pairs that fail on their own.

Claims (method.md §8; "paper" = what the paper reports):
    1 Top-θ tracks Top-k: Top-θ − Top-k at equal k, same placement and compensation (non-inferiority).
    2 post-softmax beats pre-softmax: Top-θ post + VMC − Top-θ pre + SDC + VMC (the paper's configurations), same
      k or target, kept fractions within ×1.25 (superiority). Top-k's two are equal by construction; without
      compensation the placements also differ in renormalisation (claim 3 and the compensation ablation).
    3 SDC + VMC recovers accuracy under aggressive pruning: compensated − uncompensated at each
      setting's smallest k, or its smallest target_kept for runs matched by sparsity (superiority).
    4 thresholds transfer across datasets: cross-calibrated − self-calibrated Top-θ (non-inferiority); HumanEval's
      own calibration is HumanEval-disjoint code (python_code, IN_DOMAIN), as the paper's ARC-C → HumanEval transfer.
    5 the first two layers need a larger k: layers 0-1 at their larger k − at k (superiority).
    6 several-fold fewer attention elements / V rows at ≤ 1 point: per setting (model, task, shots, metric) and
      method, the largest reduction (1/kept) among the runs non-inferior to dense at 95 %; holds in a setting where
      Top-θ reaches ≥ 3× (reduction.py, which also marks where 10× is reached).

Only informative settings are pooled (informative.py: dense at least 10 points above chance and below its ceiling);
the others are decided on their own and reported apart (Verdict.uninformative). Runs of one configuration
calibrated with several seeds are one measurement (seeds.py) whose seeds the bootstrap resamples with the
questions; every bound carries its Monte Carlo error, and precision.py resamples more where a verdict depends on
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from . import comparisons, informative, labels, paired, pooled, precision, reduction
from .comparisons import (CALIBRATION, LEVEL, MARGIN, Verdict, as_text, close, find_pairs, pick,
                          self_calibrated)

def decide(kind: str, low: float, high: float, margin: float = MARGIN) -> str:
    """The verdict rule of the module docstring."""
    bound = 0.0 if kind == "superiority" else -margin
    if low > bound:
        return "holds"
    if high < bound:
        return "fails"
    return "undecided"


def pool(pairs: Sequence[paired.PairedOutcomes | paired.PairedDifference]) -> tuple[float, float, float]:
    """The claim's effect (mean pair difference) and its 95 % interval, shared questions resampled jointly."""
    return pooled.pooled_bootstrap(pairs, level=LEVEL)


def boundary(kind: str, margin: float = MARGIN) -> float:
    """The value decide() compares the bounds with."""
    return 0.0 if kind == "superiority" else -margin


def precise_pool(kind: str, pairs: Sequence, levels: Sequence[float] = (LEVEL,)) -> list[precision.Interval]:
    """pool() at each level, resampled until the bounds the verdict depends on are precise (precision.py)."""
    return precision.precise(pairs, levels=levels, boundary=boundary(kind))


def decided(claim: str, kind: str, pairs: list[dict], note: str = "") -> Verdict:
    """A claim decided on its pairs (find_pairs' dicts): pooled effect, interval, verdict, and per setting."""
    v = Verdict(claim, kind, [{k: x for k, x in p.items() if k != "_d"} for p in pairs], note=note)
    if pairs:
        (i,) = precise_pool(kind, [p["_d"] for p in pairs])
        v.effect, v.ci_low, v.ci_high, v.mc_low, v.mc_high, v.resamples = (i.effect, i.low, i.high, i.mc_low,
                                                                           i.mc_high, i.resamples)
        v.verdict = decide(kind, v.ci_low, v.ci_high)
        v.settings = per_setting(kind, pairs)
    return v


def per_setting(kind: str, pairs: Sequence[dict]) -> list[dict[str, Any]]:
    """The claim in each setting (a group: model, task, shots, questions) on its own pairs, pooled as the claim is.

    A claim that holds pooled can still fail in one setting (one task, one model); the pooled verdict does
    not show it. Testing m settings, about m × 2.5 % of them fail at 95 % by chance alone, so each setting is
    decided twice: at 95 % (nominal) and at 1 − 0.05/m (Bonferroni over the claim's m settings; a failure
    there is a disagreement with the paper, not noise)."""
    groups: dict[str, list[dict]] = {}
    for p in pairs:
        groups.setdefault(p["group"], []).append(p)
    adjusted = 1 - (1 - LEVEL) / len(groups)
    out = []
    for group, members in sorted(groups.items()):
        nominal, strict = precise_pool(kind, [p["_d"] for p in members], levels=(LEVEL, adjusted))
        effect, low, high, low_adj, high_adj = nominal.effect, nominal.low, nominal.high, strict.low, strict.high
        worst = min(members, key=lambda p: p["ci_high"])
        out.append({"group": group, "pairs": len(members), "effect": effect, "ci_low": low, "ci_high": high,
                    "mc_low": nominal.mc_low, "mc_high": nominal.mc_high,
                    "verdict": decide(kind, low, high), "level_adjusted": adjusted, "ci_low_adjusted": low_adj,
                    "ci_high_adjusted": high_adj, "mc_low_adjusted": strict.mc_low,
                    "mc_high_adjusted": strict.mc_high, "resamples": nominal.resamples,
                    "verdict_adjusted": decide(kind, low_adj, high_adj),
                    "weakest_pair": f"{worst['a']} − {worst['b']}"
                                    + (f" at k = {worst['k']:g}" if worst.get("k") is not None else "")
                                    + f": {worst['diff']:+.3f} [{worst['ci_low']:+.3f}, {worst['ci_high']:+.3f}]"})
    return out


# ---------------------------------------------------------------- the claims


def verdicts(summary: pd.DataFrame, results_dir: str | Path | None = None) -> list[Verdict]:
    """Every claim, pooled over the informative settings (informative.py); each Verdict's `uninformative` holds the
    claim in each excluded setting, decided on its own (reported apart, never pooled)."""
    results_dir = Path(results_dir) if results_dir is not None else None
    rows = comparisons.store_rows(summary)
    if rows.empty:
        return [Verdict(c, k) for c, k in CLAIMS]
    admitted = informative.informative_groups(informative.settings_table(summary, results_dir))
    chosen = rows["group"].isin(admitted)
    found = [decided(claim, kind, pairs, note) for (claim, kind), (pairs, note)
             in zip(CLAIMS, _claim_pairs(rows[chosen], results_dir))]
    apart = _claim_pairs(rows[~chosen], results_dir) if (~chosen).any() else [([], "")] * len(found)
    for v, (pairs, _) in zip(found, apart):
        v.uninformative = per_setting(v.kind, pairs) if pairs else []
    superseded = comparisons.superseded_runs(rows)
    left_out = sorted(set(rows.loc[rows["run_id"].isin(superseded) & chosen, "group"]))
    table = reduction.reduction_table(rows[chosen], results_dir, superseded)
    six = reduction.claim_verdict(CLAIMS[5], table, left_out)
    six.table = reduction.public(table)
    six.uninformative = reduction.setting_verdicts(reduction.reduction_table(rows[~chosen], results_dir, superseded))
    return [*found, six]


def _claim_pairs(rows: pd.DataFrame, results_dir: Path | None) -> list[tuple[list[dict], str]]:
    """The pairs of claims 1-5 among `rows`, each with its note."""
    if rows.empty:
        return [([], "")] * 5
    sizes = comparisons.sample_sizes(rows)  # a pair speaks from the largest sample holding both runs' configurations
    main = rows[[labels.main_series(str(s)) for s in rows["series"]]]
    out = []
    same = ["level", "fewshot_sampler"]  # equal k, or equal target_kept where runs were matched by sparsity

    same_k = [*same, "calib_task"]
    pairs = []
    for placement, comp_theta, comp_k in (("post", "vmc", "vmc"), ("post", "none", "none"), ("pre", "none", "none"),
                                          ("pre", "sdc=exact+vmc", None)):
        if comp_k is None:  # Top-k pre + exact SDC + VMC is Top-k post + VMC (run once)
            pairs += find_pairs(main, pick("toptheta", "pre", comp_theta), pick("topk", "post", "vmc"), same,
                                results_dir, sizes=sizes)
        else:
            pairs += find_pairs(main, pick("toptheta", placement, comp_theta), pick("topk", placement, comp_k), same,
                                results_dir, sizes=sizes)
    out.append((pairs, "Top-θ − Top-k at equal k (or equal target_kept, each run within ±10 % of it)"))

    # The paper's two configurations only. Without compensation the placements differ in more than placement: a
    # pre-softmax row is renormalised over its kept keys, a post-softmax row keeps its dense probabilities (weights
    # summing to the kept mass), which is claim 3's question, not this one (the compensation ablation shows it).
    # Top-k post + VMC equals Top-k pre + exact SDC + VMC (method.md §3), so Top-k gives no pair.
    near = lambda a, b: close(a["kept_attention_fraction"], b["kept_attention_fraction"])  # noqa: E731
    pairs = find_pairs(main, pick("toptheta", "post", "vmc"), pick("toptheta", "pre", "sdc=exact+vmc"), same_k,
                       results_dir, near, sizes=sizes)
    out.append((pairs, "Top-θ post + VMC − pre + SDC + VMC (the paper's configurations), kept fractions within ×1.25"))

    aggressive = main[most_aggressive(main)]
    pairs = []
    for sparsifier, a_comp, b_comp, placement_b in (("toptheta", "sdc=exact+vmc", "none", "pre"),
                                                    ("toptheta", "vmc", "none", "post"),
                                                    ("topk", "vmc", "none", "pre"), ("topk", "vmc", "none", "post")):
        placement_a = "pre" if "sdc" in a_comp else "post"
        pairs += find_pairs(aggressive, pick(sparsifier, placement_a, a_comp), pick(sparsifier, placement_b, b_comp),
                            same_k, results_dir, sizes=sizes)
    out.append((pairs, "compensated − uncompensated at each setting's smallest k (or smallest target_kept)"))

    theta = rows[rows["sparsifier"] == "toptheta"]
    cross = lambda r: as_text(r["calib_task"]) != "" and not self_calibrated(r)  # noqa: E731
    # the pair differs in the calibration task only: the rest of the calibration (rule, statistic, σ_add, TAC,
    # granularity, documents) is equal. Not the seeds: a configuration calibrated on several draws is one measurement
    # whose draws the bootstrap resamples (seeds.py), so it pairs whatever draws the other side has (keying on
    # calib_seed dropped every pair once the self-calibrated side gained a second draw; draw 0 of another task's
    # documents is not the same documents anyway).
    equal = [*same, "placement", "comp", *(c for c in CALIBRATION if c != "calib_task"), "calib_compensation"]
    pairs = find_pairs(theta, cross, self_calibrated, equal, results_dir, sizes=sizes)
    out.append((pairs, "cross-dataset − self-calibrated Top-θ, equal in all else of the calibration"))

    protected = lambda r: as_text(r["layer_k"]) not in ("", "none")  # noqa: E731
    unprotected = lambda r: as_text(r["layer_k"]) == "none"  # noqa: E731
    pairs = find_pairs(rows[rows["sparsifier"] != "dense"], protected, unprotected,
                       [*same, "sparsifier", "placement", "comp", "calib_task", "granularity", "calib_documents"],
                       results_dir, sizes=sizes)  # whatever draws each side has, as in claim 4
    out.append((pairs, "layers 0-1 at a larger k − at k"))
    return out


def most_aggressive(rows: pd.DataFrame) -> pd.Series:
    """Whether each row is at its setting's most aggressive level for its sparsifier: the smallest k among the runs at
    a fixed k, the smallest target_kept among the runs matched by sparsity (whose k differs between methods and
    compensations by design: compensation changes the calibrated thresholds, hence the k that meets a target)."""
    target = pd.to_numeric(rows["target_kept"], errors="coerce") if "target_kept" in rows else pd.Series(
        float("nan"), index=rows.index)
    matched = target.notna()
    chosen = pd.Series(False, index=rows.index)
    for mask, level in ((~matched, pd.to_numeric(rows["k"], errors="coerce")), (matched, target)):
        if mask.any():
            level = level[mask]
            smallest = level.groupby([rows.loc[mask, "group"], rows.loc[mask, "sparsifier"]]).transform("min")
            chosen[mask] = level == smallest
    return chosen


CLAIMS = (
    ("1. Top-θ tracks Top-k", "non-inferiority"),
    ("2. post-softmax beats pre-softmax", "superiority"),
    ("3. SDC + VMC recovers accuracy under aggressive pruning", "superiority"),
    ("4. thresholds transfer across datasets", "non-inferiority"),
    ("5. the first two layers need a larger k", "superiority"),
    ("6. several-fold fewer attention elements / V rows at ≤ 1 point", "non-inferiority"),
)


def verdict_table(results: Sequence[Verdict]) -> pd.DataFrame:
    return pd.DataFrame([v.as_row() for v in results])


def pairs_table(results: Sequence[Verdict]) -> pd.DataFrame:
    rows = [{"claim": v.claim.split(".")[0], **p} for v in results for p in v.pairs]
    return pd.DataFrame(rows)


def settings_table(results: Sequence[Verdict]) -> pd.DataFrame:
    """Every claim in every setting (per_setting), one row each; `informative` says whether the setting is pooled
    (uninformative settings are decided on their own and reported apart)."""
    rows = [{"claim": v.claim.split(".")[0], "informative": flag, **s} for flag in (True, False) for v in results
            for s in (v.settings if flag else v.uninformative)]
    return pd.DataFrame(rows)


STATISTICS_NOTE = (
    "Intervals: a percentile bootstrap that resamples each task's questions once for all pairs on it and, where a "
    "configuration was calibrated with several seeds (`calib_seed`), its seeds with replacement too (a two-stage "
    "bootstrap: the interval holds the calibration draw's variance; chosen over deciding on the least favourable "
    "seed, which would make the verdict depend on how many seeds were run). Each bound is given with its Monte "
    "Carlo error (the spread of the resampled effects around its rank); where a bound lies within "
    f"{precision.DECISIVE:g} Monte Carlo errors of its decision boundary, the bootstrap is rerun with "
    f"{precision.GROWTH}× the resamples (up to {precision.MAX_RESAMPLES:,}) until that error is at most "
    f"{precision.PRECISION:g}.")


def disagreements(results: Sequence[Verdict], margin: float = MARGIN) -> list[str]:
    """Plain sentences on where the store disagrees with the paper: claims that fail; superiority claims still
    undecided whose interval already rules out a gain of `margin` or more (the paper reports an advantage; here
    any advantage is smaller than a point, however many more pairs are run); and, for a claim that does not
    fail pooled, the settings where it fails on their own (per_setting), Bonferroni-adjusted or only nominally."""
    lines = []
    for v in results:
        if not v.pairs or v.effect is None:
            continue
        pairs = f"{len(v.pairs)} pair" + ("" if len(v.pairs) == 1 else "s")
        measured = f"measured {v.effect:+.3f} [{v.ci_low:+.3f}, {v.ci_high:+.3f}] over {pairs}"
        if v.verdict == "fails":
            lines.append(f"{v.claim}: fails, {measured} ({v.note}).")
            continue
        if v.kind == "superiority" and v.verdict == "undecided" and v.ci_high < margin:
            lines.append(f"{v.claim}: no gain of {margin:g} or more here, {measured}: on these models the effect "
                         f"is at most {v.ci_high:+.3f}, if there is one ({v.note}).")
        for s in v.settings:
            if s["verdict"] != "fails":
                continue
            if "weakest_pair" not in s:  # claim 6 (reduction.setting_verdicts): no Top-θ run at ≥ 3× stays close
                lines.append(f"{v.claim}, {s['group']}: fails in this setting: every Top-θ run keeping ≤ 1/3 loses more "
                             f"than {margin:g} (closest: {s['series']}, {s['diff']:+.3f} [{s['ci_low']:+.3f}, "
                             f"{s['ci_high']:+.3f}]).")
                continue
            m = len(v.settings)
            strength = (f"and still at {s['level_adjusted']:.4g} (Bonferroni over the claim's {m} settings): "
                        f"[{s['ci_low_adjusted']:+.3f}, {s['ci_high_adjusted']:+.3f}]"
                        if s["verdict_adjusted"] == "fails" else
                        f"nominally: not at {s['level_adjusted']:.4g} (Bonferroni over the claim's {m} settings, "
                        f"where about {m * (1 - LEVEL) / 2:.2g} would fail by chance alone)" if m > 1 else "")
            lines.append(f"{v.claim}, {s['group']}: fails in this setting (pooled verdict: {v.verdict}), "
                         f"{s['effect']:+.3f} [{s['ci_low']:+.3f}, {s['ci_high']:+.3f}] over {s['pairs']} "
                         f"pairs at 95 % {strength}; weakest pair {s['weakest_pair']}.")
        bound = 0.0 if v.kind == "superiority" else -margin
        failing = [p for p in v.pairs if p.get("ci_high") is not None and p["ci_high"] < bound]
        if failing:
            named = "; ".join(f"{p['group']}: {p['a']} − {p['b']}" + (f" at k = {p['k']:g}" if p.get("k") is not None
                                                                       else "")
                              + f" {p['diff']:+.3f} [{p['ci_low']:+.3f}, {p['ci_high']:+.3f}]" for p in failing)
            lines.append(f"{v.claim}: {len(failing)} of its {len(v.pairs)} pairs fail on their own at 95 % (about "
                         f"{len(v.pairs) * (1 - LEVEL) / 2:.2g} would by chance alone were every pair's true "
                         f"difference exactly {bound:+.2f}; "
                         f"pooled verdict: {v.verdict}): {named}.")
    return lines
