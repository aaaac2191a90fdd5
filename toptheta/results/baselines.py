"""Top-θ against today's threshold baselines at equal sparsity (issue 30): does calibrating θ per (layer, head, row
length) and putting the dropped mass back (SDC, VMC) beat the simpler rules that reached production since the paper?

Baselines (sparsifiers/topp.py, sparsifiers/skipsoftmax.py): top-p after the softmax with VMC; skip-softmax (BLASST)
before the softmax without compensation, as deployed; skip-softmax after the softmax with VMC. Each is compared with
Top-θ post + VMC and Top-θ pre + SDC + VMC (calibrated on the evaluated task, as the baselines' λ and p are fitted
on it; the cross-dataset runs of claim 4 stay out, and on both sides the tagged variants: only the paper's series
pool, as in the paper's claims) at the same matched target (``sparsifier.target_kept``: each run within ±10 % of the
target kept fraction, comparisons.on_target), in the same setting (model, task, shots, fixed exemplars, questions),
paired per question. The claim per baseline: Top-θ − baseline > 0 (superiority), pooled over its pairs in the
informative settings as the paper's claims are (verdicts.py); the interval also answers non-inferiority at one
point.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import comparisons, informative, labels
from .comparisons import MATCHED_SLACK, Verdict, as_text, find_pairs, self_calibrated
from .verdicts import decided

BASELINES = (("topp", "post", "vmc", "top-p post + VMC"),
             ("skipsoftmax", "pre", "none", "skip-softmax pre (as deployed)"),
             ("skipsoftmax", "post", "vmc", "skip-softmax post + VMC"))
TOPTHETA = (("toptheta", "post", "vmc"), ("toptheta", "pre", "sdc=exact+vmc"))
# What each report pools, said beside its table (the two differ, and their pair counts with them)
SCOPE_LONG_ROWS = ("Here: the long-row settings alone (at least 10 fixed exemplars); "
                   "`figures/baseline_verdicts.md` pools every setting with matched baseline runs.")
SCOPE_ALL = ("Here: every setting with matched baseline runs, zero-shot and long rows; results/README.md's long-row "
             "section pools the long-row settings alone, so its pair counts are smaller where other settings add "
             "pairs.")


def _picks(sparsifier: str, placement: str, comp: str):
    """A row filter for find_pairs: matched runs (target_kept set) of this method in the paper's series
    (comparisons.pick: no ablation tag, as the paper's claims pick their runs), Top-θ calibrated on its own task.

    Tagged variants have their own tables and stay out: Top-θ calibrated to Top-ρ's budget (THETA_BUDGET_NOTE: its
    per-head weights may come from a baseline's evaluated run), a budget per layer (LAYER_BUDGET_NOTE), layers 0-1
    at k, and a long-row run whose rows outgrew its calibration ('rows past calibration', regimes.py)."""
    paper = comparisons.pick(sparsifier, placement, comp)

    def chosen(row: pd.Series) -> bool:
        return (paper(row) and as_text(row["target_kept"]) != ""
                and (sparsifier != "toptheta" or self_calibrated(row)))
    return chosen


def baseline_verdicts(summary: pd.DataFrame, results_dir: str | Path | None = None) -> list[Verdict]:
    """One verdict per baseline: Top-θ (both series) − the baseline at equal target, informative settings pooled."""
    results_dir = Path(results_dir) if results_dir is not None else None
    rows = comparisons.store_rows(summary)
    claims = [f"Top-θ beats {label} at equal sparsity" for *_, label in BASELINES]
    if rows.empty:
        return [Verdict(claim, "superiority") for claim in claims]
    admitted = informative.informative_groups(informative.settings_table(summary, results_dir))
    chosen = rows[rows["group"].isin(admitted)]
    sizes = comparisons.sample_sizes(chosen)
    found = []
    for claim, (name, placement, comp, label) in zip(claims, BASELINES):
        pairs = []
        for theta in TOPTHETA:
            pairs += find_pairs(chosen, _picks(*theta), _picks(name, placement, comp), ["level", "fewshot_sampler"],
                                results_dir, sizes=sizes)
        found.append(decided(claim, "superiority", pairs, f"Top-θ − {label} at the same target_kept"))
    return found


MATCHED_PAIR_COLUMNS = ["group", "series", "kept_attention_fraction", "value", "versus", "versus_kept", "versus_value",
                        "diff", "ci_low", "ci_high", "diff_method", "run_id", "versus_run_id"]


def _matched_note(runs: str, subject: str, remainder: str) -> str:
    """The text of a matched_pairs table: which ``runs`` it picks, the rule that pairs them (MATCHED_SLACK), the sign
    of its diff (``subject`` − the other) and what the pairs leave to explain (``remainder``)."""
    return (f"{runs} against every other sparse run of their setting that kept as much of the attention (kept fractions "
            f"within ±{MATCHED_SLACK * 100:.0f} % of each other): diff = {subject} − the other, paired per question. "
            f"{remainder}")


LAYER_BUDGET_NOTE = _matched_note(
    f"Runs given a budget per layer (series tagged '[{labels.PER_LAYER_K}]'; "
    "`experiments/long_rows/smol_layer_budget`: every layer's k from a baseline's per-layer kept fractions, "
    "`scripts/layer_budget.py`)",
    "the per-layer run",
    "Against the baseline whose budget it took, what is left is which keys each layer keeps; against the "
    "same method with its usual budget, how the budget is spread over the layers.")

ALLOCATION_NOTE = _matched_note(
    "Top-ρ runs (sparsifiers/toprho.py; `experiments/long_rows/smol_proportional`: Top-k's exact ranking with "
    "⌈ρ·n⌉ keys per row instead of k, so a row's budget grows with its length as skip-softmax's does)",
    "Top-ρ",
    "Against Top-k, what is left is how the budget is spread over the rows; against skip-softmax, which keys a row "
    "keeps.")


HEAD_BUDGET_NOTE = _matched_note(
    f"Top-ρ runs given a share per head (series tagged '[{labels.PER_HEAD_RHO} <digest of the weights>]'; "
    "`experiments/long_rows/smol_head_budget`: head h of layer l keeps min(1, ρ·w[l][h]) of each row, w from the "
    "shares a baseline's heads kept, `scripts/head_budget.py`)",
    "the per-head run",
    "Against the baseline whose shares it took, what is left is which rows of a head and which keys of a row it "
    "keeps; against Top-ρ with one share for every head, how the budget is spread over the heads; against a run "
    "with the same weights shuffled over each layer's heads (`experiments/long_rows/smol_head_budget_shuffled`), "
    "which heads get more.")

THETA_BUDGET_NOTE = _matched_note(
    f"Top-θ runs calibrated to Top-ρ's kept sets (series tagged '[{labels.THETA_FOR_RHO}]', with "
    f"'[{labels.PER_HEAD_RHO} <digest>]' at a share per head; `sparsifier.budget=toprho`, "
    "`experiments/long_rows/smol_theta_for_rho` and `smol_theta_head_budget`: θ approximates the edge of a row's "
    "⌈ρ·w·n⌉ largest scores instead of its k largest)",
    "Top-θ calibrated to Top-ρ",
    "Against the Top-ρ run of the same weights, what is left is a static threshold in place of an exact ranking; "
    "against Top-θ at k, how the budget is spread over rows and heads; against skip-softmax, a calibrated θ in place "
    "of max + ln(λ/n).")


def _series_tagged(tag: str):
    """chosen for matched_pairs: the runs whose series carries ``[tag]`` (or ``[tag …]``: the per-head tag carries
    its weights' digest)."""
    return lambda rows: rows["series"].astype(str).str.contains(f"[{tag}]", regex=False) \
        | rows["series"].astype(str).str.contains(f"[{tag} ", regex=False)


def layer_budget_pairs(summary: pd.DataFrame, results_dir: str | Path | None = None) -> pd.DataFrame:
    """The pairs LAYER_BUDGET_NOTE describes (labels.PER_LAYER_K tags the per-layer runs; MATCHED_SLACK)."""
    return matched_pairs(summary, results_dir, _series_tagged(labels.PER_LAYER_K))


def allocation_pairs(summary: pd.DataFrame, results_dir: str | Path | None = None) -> pd.DataFrame:
    """The pairs ALLOCATION_NOTE describes: each Top-ρ run with one share for every head against the runs of its
    setting that kept as much (but the per-head ones: head_budget_pairs has them)."""
    per_head = _series_tagged(labels.PER_HEAD_RHO)
    return matched_pairs(summary, results_dir, lambda rows: (rows["sparsifier"].astype(str) == "toprho")
                         & ~per_head(rows), versus=lambda rows: ~per_head(rows))


def head_budget_pairs(summary: pd.DataFrame, results_dir: str | Path | None = None) -> pd.DataFrame:
    """The pairs HEAD_BUDGET_NOTE describes (labels.PER_HEAD_RHO tags the per-head runs; MATCHED_SLACK); two
    per-head runs with other weights are paired once too. Top-θ at such shares is theta_budget_pairs' (it meets the
    Top-ρ runs here as one of the others)."""
    theta = _series_tagged(labels.THETA_FOR_RHO)
    return matched_pairs(summary, results_dir,
                         lambda rows: _series_tagged(labels.PER_HEAD_RHO)(rows) & ~theta(rows), within=True)


def theta_budget_pairs(summary: pd.DataFrame, results_dir: str | Path | None = None) -> pd.DataFrame:
    """The pairs THETA_BUDGET_NOTE describes (labels.THETA_FOR_RHO tags Top-θ calibrated to Top-ρ; MATCHED_SLACK);
    two such runs of other series are paired once too."""
    return matched_pairs(summary, results_dir, _series_tagged(labels.THETA_FOR_RHO), within=True)


@dataclass(frozen=True)
class MatchedTable:
    """A table of matched_pairs that the README's baselines section and the figures show."""

    name: str  # results/figures/<name>.*
    section: str  # its subsection title in results/README.md
    caption: str  # its figure's title
    pairs: Callable[[pd.DataFrame, str | Path | None], pd.DataFrame]
    note: str


MATCHED_TABLES = (
    MatchedTable("baseline_layer_budget", "At the baseline's per-layer budget",
                 "Runs at a baseline's per-layer budget against runs keeping as much", layer_budget_pairs,
                 LAYER_BUDGET_NOTE),
    MatchedTable("baseline_allocation", "With a budget that grows with the row (Top-ρ)",
                 "Top-ρ against runs keeping as much", allocation_pairs, ALLOCATION_NOTE),
    MatchedTable("baseline_head_budget", "With a share per head (Top-ρ at a baseline's per-head shares)",
                 "Top-ρ at a baseline's per-head shares against runs keeping as much", head_budget_pairs,
                 HEAD_BUDGET_NOTE),
    MatchedTable("baseline_theta_budget", "Top-θ calibrated to Top-ρ's budget",
                 "Top-θ calibrated to Top-ρ against runs keeping as much", theta_budget_pairs, THETA_BUDGET_NOTE),
)


def matched_pairs(summary: pd.DataFrame, results_dir: str | Path | None, chosen, versus=None,
                  within: bool = False) -> pd.DataFrame:
    """Each run ``chosen(rows)`` marks (a boolean Series over comparisons.store_rows) against every other sparse run of
    its setting, not marked (and marked by ``versus`` where given), whose kept attention fraction is within
    MATCHED_SLACK of its own; paired per question. ``within``: two marked runs of other series are paired too, once
    (the one listed first in the store's order against the other)."""
    results_dir = Path(results_dir) if results_dir is not None else None
    rows = comparisons.store_rows(summary)
    if rows.empty:
        return pd.DataFrame(columns=MATCHED_PAIR_COLUMNS)
    tagged = chosen(rows)
    out = []
    for _, a in rows[tagged].iterrows():
        other = ~tagged | (tagged & (rows.index > a.name) & (rows["series"] != a["series"]) if within else False)
        others = rows[(rows["group"] == a["group"]) & other & (rows["series"] != "Baseline")
                      & (versus(rows) if versus is not None else True)]
        for _, b in others.iterrows():
            if abs(float(b["kept_attention_fraction"]) / float(a["kept_attention_fraction"]) - 1) > MATCHED_SLACK:
                continue
            d, _ = comparisons.compare_rows(a, b, results_dir)
            out.append({"group": a["group"], "series": a["series"],
                        "kept_attention_fraction": a["kept_attention_fraction"], "value": a["value"],
                        "versus": b["series"], "versus_kept": b["kept_attention_fraction"], "versus_value": b["value"],
                        "diff": d.diff, "ci_low": d.ci_low, "ci_high": d.ci_high, "diff_method": d.method,
                        "run_id": a["run_id"], "versus_run_id": b["run_id"]})
    table = pd.DataFrame(out, columns=MATCHED_PAIR_COLUMNS)
    return table.sort_values(["group", "series", "diff"], kind="stable").reset_index(drop=True)
