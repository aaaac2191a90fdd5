"""Ablation tables and figures from the store: one setting varied, everything else equal.

An ablation is a column of summary.csv (ABLATIONS): compensation, θ granularity, the larger k of layers
0-1, the number of calibration documents, the empty-row rule, the softmax placement, the calibration
task (cross-dataset transfer). Within one evaluation setting (model, task, metric, shots, limit), runs
that agree on every other setting and k (runs matched by sparsity: on target_kept, whatever k each
resolved) form a cell; a cell whose runs take two or more values of the column is an ablation. Each
row of the table is one run, with its difference to the cell's reference value: paired per question when
both run directories kept per-sample outputs (paired.py), otherwise from the two stderrs (labelled so).
The figures plot the metric against the kept attention fraction
(log scale), one curve per value, so "at equal kept fraction" comparisons are read off the x axis.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from ..store.samples import read_samples, samples_path
from . import figures, labels, paired, selection

SETTINGS = ("sparsifier", "placement", "comp", "granularity", "layer_k", "calib_task", "calib_statistic",
            "sigma_add", "tac", "calib_documents", "calib_compensation", "empty_rows", "k", "target_kept", "calib_seed",
            "fewshot_sampler")
COLUMNS = ["model", "task", "num_fewshot", "limit", "metric", "series", "k", "target_kept", "setting", "value",
           "stderr", "kept_attention_fraction", "kept_vrow_fraction", "empty_row_count", "clamped_rows", "diff",
           "ci_low", "ci_high", "p_mcnemar", "n_paired", "diff_method", "reference", "run_id"]


@dataclass(frozen=True)
class Ablation:
    name: str
    column: str
    title: str
    reference: Any = None  # the value the others are compared with (None: the cell's most common/largest)
    sparsifiers: tuple[str, ...] = ("topk", "toptheta")


ABLATIONS = {a.name: a for a in (
    Ablation("compensation", "comp", "Compensation: none, SDC estimators, SDC + VMC", "none"),
    Ablation("granularity", "granularity", "Top-θ calibration granularity", "layer-head-n", ("toptheta",)),
    Ablation("first_layers", "layer_k", "Layers 0-1 at a larger k", "none"),
    Ablation("calib_size", "calib_documents", "Top-θ calibration-set size", None, ("toptheta",)),
    Ablation("empty_rows", "empty_rows", "Top-θ empty-row rule: keep the maximum vs the reference code", "keep-max",
             ("toptheta",)),
    Ablation("placement", "placement", "Pre- vs post-softmax placement", "pre"),
    Ablation("transfer", "calib_task", "Top-θ thresholds: self-calibrated vs cross-dataset", None, ("toptheta",)),
)}


def _prepared(summary: pd.DataFrame, model: str, task: str, metric: str, num_fewshot: Any, limit: Any) -> pd.DataFrame:
    df = figures.tradeoff_table(summary, model=model, task=task, metric=metric, num_fewshot=num_fewshot, limit=limit)
    if df.empty:
        return df
    theta = df["sparsifier"] == "toptheta"
    if "empty_rows" in df:  # stores from before the option: the rule was keep-max
        df.loc[theta & df["empty_rows"].isna(), "empty_rows"] = "keep-max"
    if "granularity" in df:
        df.loc[theta & df["granularity"].isna(), "granularity"] = labels.DEFAULT_GRANULARITY
    return df


def _key_frame(df: pd.DataFrame, ablation: Ablation) -> pd.DataFrame:
    keys = pd.DataFrame({c: df[c].astype(str) if c in df else "" for c in SETTINGS if c != ablation.column},
                        index=df.index).fillna("")
    if "target_kept" in df:  # runs matched by sparsity meet in a cell at their target, whatever k each resolved
        keys.loc[pd.to_numeric(df["target_kept"], errors="coerce").notna(), "k"] = ""
    if ablation.column == "placement":  # pre + SDC (+VMC) pairs with post (+VMC): SDC is pre-softmax's own part
        keys["comp"] = df["comp"].fillna("").map(lambda c: "vmc" if "vmc" in c else "none")
    return keys.replace({"nan": "", "None": ""})


def ablation_table(summary: pd.DataFrame, ablation: str | Ablation, *, model: str, task: str, metric: str,
                   num_fewshot: Any = selection.ANY, limit: Any = selection.ANY,
                   results_dir: str | Path | None = None) -> pd.DataFrame:
    """The runs of one evaluation setting that vary `ablation`'s column, with differences to the reference."""
    ab = ABLATIONS[ablation] if isinstance(ablation, str) else ablation
    df = _prepared(summary, model, task, metric, num_fewshot, limit)
    baseline = df[df["series"] == "Baseline"] if not df.empty else df
    df = df[df["sparsifier"].isin(ab.sparsifiers)] if not df.empty else df
    if df.empty or ab.column not in df:
        return pd.DataFrame(columns=COLUMNS)
    df = df.assign(setting=df[ab.column].astype(object).where(df[ab.column].notna(), "none"))
    keys = _key_frame(df, ab)
    out = []
    for _, cell in df.groupby([keys[c] for c in keys.columns], dropna=False, sort=False):
        if cell["setting"].astype(str).nunique() < 2:
            continue
        reference = _reference(cell, ab)
        ref_row = cell[cell["setting"].astype(str) == str(reference)].iloc[0]
        for row in cell.to_dict("records"):
            out.append(_with_difference(row, ref_row, reference, ab, results_dir, task, metric))
    if not out:
        return pd.DataFrame(columns=COLUMNS)
    table = pd.DataFrame(out)
    table["series"] = [_base_label(r, ab) for r in table.to_dict("records")]
    table = pd.concat([baseline.assign(setting="dense"), table], ignore_index=True) if len(baseline) else table
    for col in COLUMNS:
        if col not in table:
            table[col] = None
    order = sorted(table["setting"].astype(str).unique(), key=lambda v: (_num_or_inf(v), v))
    table["_order"] = table["setting"].astype(str).map({v: i for i, v in enumerate(order)})
    table = table.sort_values(["series", "target_kept", "k", "_order"], key=figures.sort_key, kind="stable")
    return table[COLUMNS].reset_index(drop=True)


def _num_or_inf(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return float("inf")


def _reference(cell: pd.DataFrame, ab: Ablation) -> Any:
    values = list(cell["setting"].astype(str))
    if ab.reference is not None and str(ab.reference) in values:
        return ab.reference
    if ab.column == "calib_task":  # self-calibrated when there is one
        own = [v for v in values if v == str(cell["task"].iloc[0])]
        if own:
            return own[0]
    numeric = [v for v in values if _num_or_inf(v) != float("inf")]
    # the most common value; ties go to the first in sorted order (a set's order changes with each process)
    return max(numeric, key=float) if numeric else max(sorted(set(values)), key=values.count)


def _base_label(row: dict, ab: Ablation) -> str:
    label = labels.sparsifier_label(row["sparsifier"])
    if ab.column != "placement":
        label += f" {row.get('placement') or ''}".rstrip()
    if ab.column not in ("comp",):
        parts = labels.comp_parts(labels.cell_text(row.get("comp")))
        if ab.column == "placement":
            parts = [p for p in parts if p == "VMC"]
        label += (" (" + " ".join(f"+{p}" for p in parts) + ")") if parts else ""
    return label


def _with_difference(row: dict, ref: pd.Series, reference: Any, ab: Ablation, results_dir, task: str,
                     metric: str) -> dict:
    out = dict(row, reference=str(reference))
    if str(row["setting"]) == str(reference):
        return out
    diff = None
    if results_dir is not None:
        runs = Path(results_dir) / "runs"
        diff = paired.compare_runs(runs / row["run_id"], runs / ref["run_id"], task, metric)
    if diff is None:
        diff = paired.unpaired(row["value"], _zero(row["stderr"]), ref["value"], _zero(ref["stderr"]))
    out.update(diff=diff.diff, ci_low=diff.ci_low, ci_high=diff.ci_high, p_mcnemar=diff.p_mcnemar,
               n_paired=diff.n or None, diff_method=diff.method)
    return out


def _zero(value: Any) -> float:
    return 0.0 if value is None or pd.isna(value) else float(value)


def ablation_groups(summary: pd.DataFrame, ablation: str) -> list[dict[str, Any]]:
    """The trade-off groups (selection.tradeoff_groups) holding at least one cell of this ablation."""
    return [g for g in selection.tradeoff_groups(summary) if len(ablation_table(summary, ablation, **g))]


PANEL_CURVES = 4


def ablation_figure(table: pd.DataFrame, ablation: str | Ablation, title: str) -> Figure:
    """The metric against the kept attention fraction (log scale), one curve per (series, setting), at most
    PANEL_CURVES a panel (a series' settings kept together where they fit), the dense baseline dashed in each.
    Calibration size: against the number of documents, with two more panels, the kept attention fraction and the
    rows past the calibrated length (clamped_rows), since the calibration set changes both."""
    ab = ABLATIONS[ablation] if isinstance(ablation, str) else ablation
    by_docs = ab.column == "calib_documents"
    sparse = table[table["setting"] != "dense"]
    keys = ["series", "k"] if by_docs else ["series", "setting"]
    curves = list(sparse.groupby(keys, sort=False))
    colors = labels.series_colors([f"{a} · {b}" for (a, b), _ in curves])
    panels = [curves] if by_docs else _panels(curves)
    ncols = 3 if by_docs else min(len(panels), 3)
    nrows = 1 if by_docs else -(-len(panels) // ncols)
    fig = Figure(figsize=(11.5 if by_docs else 3.9 * ncols + 0.6, 4.6 if by_docs else 3.4 * nrows + 1.2),
                 layout="constrained")
    grid = fig.subplots(nrows, ncols, squeeze=False, sharex=not by_docs, sharey=not by_docs).ravel()
    axes = grid if by_docs else grid[:len(panels)]
    for ax in grid[len(axes):]:
        ax.set_visible(False)
    x = "calib_documents" if by_docs else "kept_attention_fraction"
    dense = table[table["setting"] == "dense"]
    metric = str(table["metric"].dropna().iloc[0]).split(",")[0] if table["metric"].notna().any() else "metric"
    for ax, members in zip(axes[:1] if by_docs else axes, panels):
        for (a, b), rows in members:
            xs = rows["setting"].astype(float) if by_docs else rows[x]
            order = xs.argsort()
            color = colors[f"{a} · {b}"]
            ax.errorbar(xs.iloc[order], rows["value"].iloc[order], yerr=rows["stderr"].fillna(0.0).iloc[order],
                        marker="o", ms=4, capsize=3, lw=1.2, color=color,
                        label=f"{a}, k={selection.as_number(b)}" if by_docs else f"{a} · {ab.column}={b}")
            if by_docs:
                for other, column in zip(axes[1:], ("kept_attention_fraction", "clamped_rows")):
                    ys = pd.to_numeric(rows[column], errors="coerce").iloc[order]
                    other.plot(xs.iloc[order], ys, marker="o", ms=4, lw=1.2, color=color)
        if len(dense):
            ax.axhline(dense["value"].iloc[0], color="black", ls="--", lw=1.2, label="Baseline (dense)")
        if not by_docs:
            ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    for each in axes:
        each.set_xscale("log")
        figures.label_log_axis(each.xaxis)
        each.grid(alpha=0.3, which="both")
    if by_docs:
        for each in axes:
            each.set_xlabel("calibration documents (log scale)")
        axes[0].set_ylabel(metric)
        axes[1].set_ylabel(figures.X_LABELS["kept_attention_fraction"])
        axes[2].set_ylabel("rows past the calibrated length (clamped_rows)")
        axes[1].set_title("kept fraction", fontsize=8)
        axes[2].set_title("rows past calibration", fontsize=8)
        fig.legend(*axes[0].get_legend_handles_labels(), fontsize=6.5, loc="outside lower center", ncols=2,
                   frameon=False)
    else:
        fig.supxlabel(figures.X_LABELS[x] + " (log scale)", fontsize=9)
        fig.supylabel(metric + " (bars: ±1 stderr)", fontsize=9)
    fig.suptitle("\n".join(textwrap.wrap(f"{ab.title}: {title}", width=130 if by_docs else 40 * ncols + 30)),
                 fontsize=8.5)
    return fig


def _panels(curves: list) -> list[list]:
    """Curves packed into panels of at most PANEL_CURVES, a series' curves together where they fit."""
    by_series: dict = {}
    for item in curves:
        by_series.setdefault(item[0][0], []).append(item)
    panels: list[list] = []
    for members in by_series.values():
        for start in range(0, len(members), PANEL_CURVES):
            chunk = members[start:start + PANEL_CURVES]
            if panels and len(panels[-1]) + len(chunk) <= PANEL_CURVES:
                panels[-1] += chunk
            else:
                panels.append(list(chunk))
    return panels or [[]]


# ---------------------------------------------------------------- passkey: accuracy per context length


PASSKEY_COLUMNS = ["series", "k", "prompts", "length", "value", "correct", "prompts_at_length", "ci_low", "ci_high",
                   "kept_attention_fraction", "kept_vrow_fraction", "stats_scope", "run_id"]


def wilson_interval(correct: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion: unlike p ± z·stderr it is not [1, 1] for 20 correct
    of 20, it says how low the accuracy could be (0.84 there at 95 %)."""
    if n < 1:
        raise ValueError("an interval needs at least one prompt")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p, z2 = correct / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


def _passkey_counts(run_dir: Path, lengths: list[int]) -> dict[int, tuple[int, int]]:
    """length -> (correct, prompts) from a run's per-prompt samples; {} without them. Older samples carry only
    the prompt's real token count: they go to the nearest of the run's lengths."""

    path = samples_path(run_dir)
    if path is None or not lengths:
        return {}
    samples = read_samples(path)
    if isinstance(samples, dict):  # lm-eval's layout, task -> samples
        samples = samples.get("passkey", [])
    counts: dict[int, list[int]] = {}
    for sample in samples:
        length = sample.get("target_tokens") or min(lengths, key=lambda n: abs(n - sample["length_tokens"]))
        counts.setdefault(int(length), [0, 0])
        counts[int(length)][0] += bool(sample["correct"])
        counts[int(length)][1] += 1
    return {length: (c, n) for length, (c, n) in counts.items()}


def passkey_table(summary: pd.DataFrame, model: str, results_dir: str | Path | None = None) -> pd.DataFrame:
    """Per-length passkey rows (task passkey_<n>) of one model: series, k, the run's prompt count (its limit: runs
    over other lengths or depths are other settings), length, accuracy and its statistics. With `results_dir`,
    the correct and total prompts per length come from each run's samples, with a 95 % Wilson interval."""
    df = selection.latest(summary)
    df = df[(df["model"] == model) & df["task"].astype(str).str.fullmatch(r"passkey_\d+")].copy()
    if df.empty:
        return pd.DataFrame(columns=PASSKEY_COLUMNS)
    df["length"] = df["task"].str.removeprefix("passkey_").astype(int)
    df["series"] = [labels.series_label(r) for r in df.to_dict("records")]
    df["prompts"] = pd.to_numeric(df["limit"], errors="coerce").astype("Int64") if "limit" in df else pd.NA
    counts = {run: _passkey_counts(Path(results_dir) / "runs" / str(run), sorted(rows["length"]))
              for run, rows in df.groupby("run_id")} if results_dir is not None else {}
    cells = [counts.get(run, {}).get(length) for run, length in zip(df["run_id"], df["length"])]
    df["correct"] = pd.array([c[0] if c else None for c in cells], dtype="Int64")
    df["prompts_at_length"] = pd.array([c[1] if c else None for c in cells], dtype="Int64")
    intervals = [wilson_interval(*c) if c else (float("nan"), float("nan")) for c in cells]
    df["ci_low"], df["ci_high"] = [i[0] for i in intervals], [i[1] for i in intervals]
    df = df.sort_values(["series", "k", "prompts", "length"], key=figures.sort_key, kind="stable")
    return df[[c for c in PASSKEY_COLUMNS if c in df]].reset_index(drop=True)


def passkey_models(summary: pd.DataFrame) -> list[str]:
    tasks = summary["task"].astype(str)
    return sorted(summary.loc[tasks.str.fullmatch(r"passkey_\d+"), "model"].dropna().unique())


def passkey_figure(table: pd.DataFrame, title: str) -> Figure:
    """Accuracy against context length, one line per series; beside it, where runs recorded statistics per length,
    the kept attention fraction (solid) and kept V-row fraction (dashed) of each sparse series at each length."""
    kept = table[[c for c in ("kept_attention_fraction", "kept_vrow_fraction") if c in table]].apply(
        pd.to_numeric, errors="coerce")
    per_length = not kept.empty and bool(kept.notna().any(axis=None))
    fig = Figure(figsize=(10.4 if per_length else 6.4, 4.0), layout="constrained")
    ax = fig.add_subplot(1, 2, 1) if per_length else fig.add_subplot()
    several = table["prompts"].nunique(dropna=False) > 1  # runs of several prompt sets: each its own line
    groups = list(table.groupby(["series", "k", "prompts"], sort=False, dropna=False))
    names = []
    for (series, k, prompts), _ in groups:
        name = series if pd.isna(k) else f"{series}, k={selection.as_number(k)}"
        names.append(f"{name} ({selection.as_number(prompts)} prompts)" if several and not pd.isna(prompts) else name)
    colors = labels.series_colors(names)
    markers = "osD^vP*X"
    for i, (((series, _, _), rows), name) in enumerate(zip(groups, names)):
        # Series often coincide (all keys found): each sits a little to the side of the true length.
        x = rows["length"] * 2 ** (0.04 * (i - (len(groups) - 1) / 2))
        low, high = rows["ci_low"].astype(float), rows["ci_high"].astype(float)
        yerr = [(rows["value"] - low).fillna(0.0).clip(lower=0), (high - rows["value"]).fillna(0.0).clip(lower=0)]
        ax.errorbar(x, rows["value"], yerr=yerr, marker=markers[i % len(markers)], ms=4, lw=1.2, capsize=3,
                    label=name, color="black" if series == "Baseline" and not several else colors.get(name))
    ax.set_xscale("log", base=2)
    lengths = sorted(table["length"].unique())
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length (tokens, log scale; series side by side)")
    ax.set_ylabel("passkey accuracy (95 % Wilson interval)")
    ax.set_title(f"Top-θ and Top-k long-context retrieval: {title}", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
    if per_length:
        _passkey_kept_panel(fig.add_subplot(1, 2, 2), groups, names, colors, lengths)
    return fig


def _passkey_kept_panel(ax, groups, names: list[str], colors: dict, lengths: list[int]) -> None:
    """Kept fractions against context length (log-log) for the series that recorded them per length."""
    for ((series, _, _), rows), name in zip(groups, names):
        for column, style in (("kept_attention_fraction", "-"), ("kept_vrow_fraction", "--")):
            if column not in rows or series == "Baseline":
                continue
            y = pd.to_numeric(rows[column], errors="coerce")
            if y.notna().any():
                ax.plot(rows["length"][y.notna()], y[y.notna()], style, marker="o", ms=3, lw=1.2,
                        color=colors.get(name), label=name if style == "-" else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    figures.label_log_axis(ax.yaxis)
    ax.set_xlabel("context length (tokens, log scale)")
    ax.set_ylabel("kept fraction (solid: attention, dashed: V rows)")
    ax.set_title("kept fractions per length (runs that recorded them)", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")

