"""Claim 6 as the paper states it: how many times fewer attention elements (or V rows) each method keeps while
staying within one point of dense.

Per setting (model, task, shots, metric; its runs on any number of questions, each against the dense run on its own
questions, a configuration also measured on more questions speaking from the larger sample only) and per method
(series), the runs are compared with dense (paired per question, calibration seeds resampled too). A run is
non-inferior when the lower bound of its paired 95 % interval of (run − dense) is above −0.01 (precision.py makes that
bound precise where the verdict depends on it). The method's **reduction** in the setting is the largest 1/kept among
its non-inferior runs: kept attention elements for QA, kept V rows for generation tasks (whose runs record them).

The claim holds in a setting when a Top-θ series reaches ≥ 3× there (HOLDS_AT); the table marks where 10× is reached
(PAPER_AT, the paper's "up to 10×"). A run matched to a target of 1/3 (or less) of the attention elements reaches 3×
when it landed within the matching protocol's tolerance of its target (MATCHED_SLACK: ±10 % on evaluated rows,
calibration/target_kept.py): the protocol's 1/3 is 3×, whether its rows kept 0.331 or 0.335. It fails in a setting when every Top-θ run keeping ≤ 1/3 is clearly worse than
dense (its interval below −0.01); it is untested where no Top-θ run keeps ≤ 1/3, and undecided otherwise. Pooled:
holds when it holds in every setting that decides (at least one), fails when it fails in one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from . import comparisons, figures, labels, precision, selection
from .comparisons import LEVEL, MARGIN, MATCHED_SLACK, Verdict, target_measure

HOLDS_AT = 3.0
PAPER_AT = 10.0
COLUMNS = ["setting", "series", "measure", "runs", "non_inferior_runs", "reduction", "kept", "k", "target_kept",
           "seeds", "diff", "ci_low", "ci_high", "mc_low", "mc_high", "resamples", "reaches_3x", "reaches_10x",
           "largest_tested_reduction", "group", "run_id"]



def reaches(run, x: str, factor: float) -> bool:
    """Whether a run keeps ``factor`` times fewer of measure ``x``: measured, or matched to a target of 1/factor or
    less of that measure (``target_measure``: the attention elements unless it says V rows) and landed within
    MATCHED_SLACK of it."""
    kept = float(run[x])
    if 1.0 / kept >= factor:
        return True
    target = selection.as_number(run.get("target_kept")) if target_measure(run) == x else None
    return isinstance(target, (int, float)) and target == target and 0 < target <= 1.0 / factor \
        and kept <= target * (1 + MATCHED_SLACK)


def _measure(family: pd.DataFrame) -> str:
    return "kept_vrow_fraction" if family["kept_vrow_fraction"].notna().any() else "kept_attention_fraction"


def reduction_table(rows: pd.DataFrame, results_dir: str | Path | None, superseded: set[str]) -> pd.DataFrame:
    """One row per (setting, series): the largest non-inferior reduction and the run that reaches it.

    `rows`: comparisons.store_rows (seeds merged); `superseded`: runs whose configuration was measured on more questions."""
    results_dir = Path(results_dir) if results_dir is not None else None
    out = []
    if rows.empty:
        return pd.DataFrame(columns=COLUMNS)
    main = rows[[labels.main_series(str(s)) for s in rows["series"]]]
    for _, family in rows.groupby(comparisons.FAMILY, dropna=False, sort=True):
        dense = {g: grp.iloc[0] for g, grp in family[family["series"] == "Baseline"].groupby("group")}
        x = _measure(family)
        candidates = main[main["run_id"].isin(family["run_id"]) & (main["series"] != "Baseline")
                          & ~main["run_id"].isin(superseded) & main["group"].isin(list(dense))
                          & main[x].notna() & (main[x] > 0)]
        first = family.iloc[0]
        setting = selection.group_title(first["g_model"], first["g_task"], first["g_metric"], first["g_num_fewshot"])
        for series, runs in candidates.groupby("series", sort=False):
            tested = []
            for _, run in runs.iterrows():
                d, data = comparisons.compare_rows(run, dense[run["group"]], results_dir)
                if not comparisons.usable(d):
                    continue
                interval = _interval(d, data)
                tested.append((run, interval))
            if not tested:
                continue
            good = [(run, i) for run, i in tested if i.low > -MARGIN]
            largest = max(1.0 / float(run[x]) for run, _ in tested)
            row = {"setting": setting, "series": series, "measure": figures.X_LABELS[x], "runs": len(tested),
                   "non_inferior_runs": len(good), "largest_tested_reduction": largest}
            if good:
                run, i = max(good, key=lambda t: (1.0 / float(t[0][x]), t[1].low))
                reduction = 1.0 / float(run[x])
                row.update(reduction=reduction, kept=float(run[x]), k=selection.as_number(run["k"]),
                           target_kept=selection.as_number(run.get("target_kept")), seeds=int(run.get("seeds", 1)),
                           diff=i.effect, ci_low=i.low, ci_high=i.high, mc_low=i.mc_low, mc_high=i.mc_high,
                           resamples=i.resamples, reaches_3x=reaches(run, x, HOLDS_AT),
                           reaches_10x=reaches(run, x, PAPER_AT), group=run["group"],
                           run_id=",".join(comparisons.run_ids(run)))
            else:  # the weakest claim we can state: the closest call among the runs keeping the least
                run, i = max(tested, key=lambda t: t[1].low)
                row.update(kept=float(run[x]), k=selection.as_number(run["k"]), diff=i.effect, ci_low=i.low, ci_high=i.high,
                           mc_low=i.mc_low, mc_high=i.mc_high, resamples=i.resamples, seeds=int(run.get("seeds", 1)),
                           reaches_3x=False, reaches_10x=False, group=run["group"],
                           run_id=",".join(comparisons.run_ids(run)))
            row["_fails"] = all(i.high < -MARGIN for run, i in tested if reaches(run, x, HOLDS_AT))
            row["_tested_3x"] = any(reaches(run, x, HOLDS_AT) for run, _ in tested)
            out.append(row)
    table = pd.DataFrame(out)
    for col in COLUMNS:
        if col not in table:
            table[col] = None
    return table[[*COLUMNS, "_fails", "_tested_3x"]] if len(table) else pd.DataFrame(columns=COLUMNS)


def _interval(d, data) -> precision.Interval:
    """The run − dense interval at 95 %, precise at the non-inferiority bound; from two stderrs when unpaired."""
    if data is d:  # no per-question outcomes: the normal interval, exact (no resampling)
        return precision.Interval(d.diff, d.ci_low, d.ci_high, 0.0, 0.0, 0, d.level)
    (i,) = precision.precise([data], levels=(LEVEL,), boundary=-MARGIN)
    return i


def public(table: pd.DataFrame) -> pd.DataFrame:
    """The table as written to disk (without the verdict's helper columns)."""
    return table[[c for c in COLUMNS if c in table]].reset_index(drop=True)


def setting_verdicts(table: pd.DataFrame) -> list[dict]:
    """The claim in each setting from Top-θ's rows of the reduction table (see the module docstring)."""
    out = []
    if table.empty:
        return out
    for setting, rows in table[table["series"].str.startswith("Top-θ")].groupby("setting", sort=True):
        best = rows.sort_values("reduction", ascending=False, na_position="last", kind="stable").iloc[0]
        if any(_flag(x) for x in rows["reaches_3x"]):
            verdict = "holds"
        elif not rows["_tested_3x"].any():
            verdict = "untested"
        elif rows.loc[rows["_tested_3x"], "_fails"].all():
            verdict = "fails"
        else:
            verdict = "undecided"
        reduction = best["reduction"]
        out.append({"group": setting, "run_group": best["group"], "verdict": verdict, "series": best["series"],
                    "reduction": None if pd.isna(reduction) else float(reduction),
                    "reaches_10x": _flag(best["reaches_10x"]), "kept": best["kept"], "runs": int(rows["runs"].sum()), "pairs": int(rows["runs"].sum()),
                    "effect": best["diff"], "diff": best["diff"], "ci_low": best["ci_low"], "ci_high": best["ci_high"],
                    "mc_low": best["mc_low"], "mc_high": best["mc_high"], "resamples": best["resamples"]})
    return out


def _count(value) -> int | None:
    return None if value is None or pd.isna(value) else int(value)


def _flag(value) -> bool:
    """A table cell as a bool: None or NaN (no run) is False."""
    return value is not None and not pd.isna(value) and bool(value)


def claim_verdict(claim: tuple[str, str], table: pd.DataFrame, left_out: Sequence[str] = ()) -> Verdict:
    """Claim 6 pooled over the settings of `table` (see the module docstring)."""
    v = Verdict(*claim)
    settings = setting_verdicts(table)
    v.settings = settings
    v.pairs = [{"group": s["run_group"], "a": s["series"], "b": "Baseline", "reduction": s["reduction"], "kept": s["kept"], "runs": s["runs"], "diff": s["diff"],
                "ci_low": s["ci_low"], "ci_high": s["ci_high"], "verdict": s["verdict"]} for s in settings]
    if not settings:
        return v
    verdict_of = [s["verdict"] for s in settings]
    decided = [x for x in verdict_of if x in ("holds", "fails")]
    v.verdict = "fails" if "fails" in decided else ("holds" if decided else "undecided")
    weakest = min((s for s in settings if s["ci_low"] is not None and not pd.isna(s["ci_low"])),
                  key=lambda s: s["ci_low"], default=None)
    if weakest is not None:
        v.effect, v.ci_low, v.ci_high = weakest["diff"], weakest["ci_low"], weakest["ci_high"]
        v.mc_low, v.mc_high, v.resamples = weakest["mc_low"], weakest["mc_high"], _count(weakest["resamples"])
    tally = ", ".join(f"{verdict_of.count(x)} {x}" for x in ("holds", "fails", "undecided", "untested") if x in verdict_of)
    tenfold = [s["group"] for s in settings if s["reaches_10x"]]
    v.note = (f"settings: {tally}; holds in a setting where Top-θ is non-inferior (95 % lower bound > −0.01) at "
              f"≥ {HOLDS_AT:g}× fewer attention elements (V rows for generation; a run matched to the 1/{HOLDS_AT:g} "
              f"target counts when its rows land within ±{MATCHED_SLACK:.0%} of it); "
              + (f"{PAPER_AT:g}× reached in: {'; '.join(tenfold)}" if tenfold else f"{PAPER_AT:g}× reached nowhere")
              + "; effect shown: the weakest setting's best Top-θ run; the table: figures/claim6_reduction.md"
              + (f"; runs left out, their configuration measured on more questions: {', '.join(left_out)}"
                 if left_out else ""))
    return v
