"""Figures and the tables behind them, from the results store (summary.csv and the run directories).

The paper's main plots (method.md §10, reference notebooks 4 and 5) are accuracy against the kept
fraction of attention elements (prefill) or of V rows (decoding), one series per method:

    Baseline | Top-θ pre (+SDC +VMC) | Top-θ post (+VMC) | Top-k pre (+SDC +VMC) | Top-k post (+VMC)

x is the store's kept fraction, a ratio of means (method.md §5); the reduction factor is 1/x; y is
the task's metric with lm-eval's stderr as the error bar. Every figure is drawn from the table
function of the same name, so a figure shows exactly the numbers its table lists.

Plain pandas and matplotlib (no pyplot state: figures are `matplotlib.figure.Figure` objects), no Hydra.
`scripts/make_figures.py` writes all of them to disk; `notebooks/ablations.ipynb` displays them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from .labels import EQUIVALENT_SERIES, GRANULARITY_ORDER, main_series, series_colors, series_key, series_label
from .selection import ANY, as_number, full_metric, group_title, select, setting_of, tradeoff_groups

X_LABELS = {"kept_attention_fraction": "kept attention elements (fraction)",
            "kept_vrow_fraction": "kept V rows (fraction)"}
TABLE_COLUMNS = ["model", "task", "num_fewshot", "limit", "metric", "series", "k", "kept_attention_fraction",
                 "kept_vrow_fraction", "value", "stderr", "value_pm_stderr", "attention_reduction",
                 "vrow_reduction", "sparsifier", "placement", "comp", "granularity", "layer_k", "calib_task",
                 "calib_documents", "calib_statistic", "sigma_add", "tac", "calib_compensation", "empty_rows",
                 "empty_row_count", "clamped_rows", "generated_tokens", "target_kept", "calib_seed",
                 "fewshot_sampler", "kept_attention_fraction_sparsified", "run_id"]


# ---------------------------------------------------------------- accuracy vs kept fraction


def tradeoff_table(summary: pd.DataFrame, *, model: str, task: str, metric: str, num_fewshot: Any = ANY,
                   limit: Any = ANY) -> pd.DataFrame:
    """The numbers behind tradeoff_figure: one row per run, the baseline first.

    Series in legend order, then k. The baseline is the latest dense run of the setting.
    attention_reduction = 1 / kept_attention_fraction and vrow_reduction = 1 / kept_vrow_fraction
    (method.md §5: the reduction factor is 1/x).
    """
    df = select(summary, model, task, metric, num_fewshot, limit)
    if df.empty:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    df = df.assign(series=[series_label(r) for r in df.to_dict("records")])
    docs = df.loc[df["sparsifier"] == "toptheta", "calib_documents"].dropna() if "calib_documents" in df else []
    if len(docs) and docs.nunique() > 1:  # calibration-set sizes other than the usual one are their own series
        usual = docs.value_counts().sort_index(ascending=False).idxmax()
        other = (df["sparsifier"] == "toptheta") & df["calib_documents"].notna() & (df["calib_documents"] != usual)
        df.loc[other, "series"] = [f"{s} [{as_number(d)} cal. docs]" for s, d in zip(df.loc[other, "series"],
                                                                              df.loc[other, "calib_documents"])]
    dense = df[df["series"] == "Baseline"]
    if "timestamp" in dense:
        dense = dense.sort_values("timestamp", kind="stable", na_position="first")
    df = pd.concat([dense.tail(1), df[df["series"] != "Baseline"]])
    df["attention_reduction"] = 1.0 / df["kept_attention_fraction"]
    df["vrow_reduction"] = 1.0 / df["kept_vrow_fraction"]
    df["value_pm_stderr"] = [_pm(v, s) for v, s in zip(df["value"], df["stderr"])]
    df["k"] = df["k"].astype("Int64")
    df = df.sort_values(["series", "k", "kept_attention_fraction"], key=sort_key, kind="stable")
    for col in TABLE_COLUMNS:
        if col not in df:
            df[col] = None
    return df[TABLE_COLUMNS].reset_index(drop=True)


GENERATION_METRICS = ("pass@1,none", "rouge_score,none", "accuracy,none", "score,none")  # score: the ruler suite's


def generation_glance(summary: pd.DataFrame) -> pd.DataFrame:
    """The generation tasks at a glance: every run of each (model, task) on its most documents, one row each.

    A task counts as generation when the metric it is judged by is one of GENERATION_METRICS (HumanEval,
    LongBench, passkey, the ruler suite and their per-length sub-tasks). Kept fractions and generated tokens as the
    store has them; "rows past calibration": the attention rows of a Top-θ run longer than its thresholds' calibrated
    length, which used the last calibrated θ (calibrating on short documents, e.g. ARC questions, for long prompts
    clamps many), or the fitted law's under calib.beyond=fit (its series tagged labels.THETA_FIT).
    """
    groups = [g for g in tradeoff_groups(summary) if g["metric"] in GENERATION_METRICS]
    def size(g: dict[str, Any]) -> float:  # documents evaluated (limit None: the whole split)
        return math.inf if g["limit"] is None else g["limit"]

    largest: dict[tuple[str, str], dict[str, Any]] = {}
    for g in groups:
        key = (g["model"], g["task"])
        if key not in largest or size(g) > size(largest[key]):
            largest[key] = g
    columns = ["setting", "series", "k", "score", "kept attention", "kept V rows", "generated tokens",
               "rows past calibration"]
    rows = []
    for g in sorted(largest.values(), key=lambda g: (g["model"], g["task"])):
        table = tradeoff_table(summary, **g)
        setting = group_title(**g)
        for r in table.to_dict("records"):
            shown = {c: "" if pd.isna(r[c]) else format(float(r[c]), spec)
                     for c, spec in (("kept_attention_fraction", ".3f"), ("kept_vrow_fraction", ".3f"),
                                     ("generated_tokens", ".0f"))}
            shown["clamped_rows"] = ("" if r["sparsifier"] != "toptheta" or pd.isna(r["clamped_rows"])
                                     else f"{int(r['clamped_rows']):,}")
            rows.append([setting, r["series"], "" if pd.isna(r["k"]) else int(r["k"]), r["value_pm_stderr"],
                         *shown.values()])
    return pd.DataFrame(rows, columns=columns)


def sort_key(col: pd.Series) -> pd.Series:
    """sort_values key: series in legend order, granularities coarse to fine, other columns as they are."""
    if col.name == "series":
        ranked = sorted(col.dropna().unique(), key=series_key)
    elif col.name == "granularity":
        ranked = sorted(col.dropna().unique(), key=lambda g: ((GRANULARITY_ORDER + (g,)).index(g), g))
    else:
        return col
    return col.map({value: i for i, value in enumerate(ranked)})


def _pm(value: float, stderr: float) -> str:
    if pd.isna(value):
        return ""
    return f"{value:.4f}" if pd.isna(stderr) else f"{value:.4f} ± {stderr:.4f}"


def x_columns(table: pd.DataFrame) -> list[str]:
    """The kept-fraction columns a trade-off figure can use: those with a value for some sparse run."""
    sparse = table[table["series"] != "Baseline"]
    return [x for x in X_LABELS if pd.to_numeric(sparse[x], errors="coerce").notna().any()]


def label_log_axis(axis) -> None:
    """Plain labels at 1-2-5 steps on a log axis (0.05, 0.1, 0.2, ...).

    Over less than a decade, as most kept fractions span, matplotlib labels one major tick or labels the minor
    ones as 2×10⁻¹; minor ticks stay for the grid, unlabelled.
    """
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def tradeoff_figure(summary: pd.DataFrame, *, model: str, task: str, metric: str,
                    x: str = "kept_attention_fraction", num_fewshot: Any = ANY, limit: Any = ANY,
                    series: Sequence[str] | None = None) -> Figure:
    """The metric against the kept fraction `x` (log scale), one curve per series sorted by x, points labelled with k.

    Error bars are the stderr; the baseline is a horizontal line with a ±stderr band. Plotted: the paper's
    series (main_series), or those named in `series`; the table (tradeoff_table) lists every run.
    Top-k post (+VMC) is labelled as the same computation as Top-k pre (+SDC +VMC), which is not run.
    """
    if x not in X_LABELS:
        raise ValueError(f"x={x!r}: use one of {', '.join(X_LABELS)}")
    table = tradeoff_table(summary, model=model, task=task, metric=metric, num_fewshot=num_fewshot, limit=limit)
    drawn = [name for name in dict.fromkeys(table["series"]) if name == "Baseline"
             or (name in series if series is not None else main_series(name))]
    crowded = len(drawn) > 5  # the legend goes below the axes, where it hides no point
    fig = Figure(figsize=(6.4, 4.2 + (0.15 * len(drawn) if crowded else 0.0)), layout="constrained")
    ax = fig.add_subplot()
    colors = series_colors(drawn)  # colours for the series drawn only: the table's others would use some up
    lowest = 1.0
    for name, rows in table.groupby("series", sort=False):
        if name not in drawn:
            continue
        color = colors[name]
        if name == "Baseline":
            value, stderr = rows["value"].iloc[0], rows["stderr"].iloc[0]
            ax.axhline(value, color=color, lw=1.2, ls="--", label="Baseline (dense)")
            if pd.notna(stderr):
                ax.axhspan(value - stderr, value + stderr, color=color, alpha=0.12, lw=0)
            continue
        rows = rows[rows[x].notna() & (rows[x] > 0)].sort_values(x)
        if rows.empty:
            continue
        lowest = min(lowest, float(rows[x].min()))
        ax.errorbar(rows[x], rows["value"], yerr=rows["stderr"].fillna(0.0), color=color, marker="o", ms=4,
                    capsize=3, lw=1.2, label=EQUIVALENT_SERIES.get(name, name))
        for xv, yv, k in zip(rows[x], rows["value"], rows["k"]):
            if pd.notna(k):
                ax.annotate(str(k), (xv, yv), textcoords="offset points", xytext=(3, 4), fontsize=7, color=color)
    ax.set_xscale("log")
    label_log_axis(ax.xaxis)
    ax.set_xlim(lowest / 1.5, 1.3)
    ax.set_xlabel(X_LABELS[x] + " (log scale)")
    ax.set_ylabel(full_metric(metric).split(",")[0])
    ax.set_title("Top-θ and Top-k (SDC, VMC): " + group_title(model, task, full_metric(metric), *setting_of(table)),
                 fontsize=8)
    ax.grid(alpha=0.3, which="both")
    if crowded:
        fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside lower center", ncols=2)
    else:
        ax.legend(fontsize=7, loc="best")
    return fig


# ---------------------------------------------------------------- threshold granularity ablation


def granularity_groups(summary: pd.DataFrame) -> list[dict[str, Any]]:
    """The trade-off groups whose Top-θ runs span at least two calibration granularities."""
    out = []
    for group in tradeoff_groups(summary):
        rows = select(summary, **group)
        if rows.loc[rows["sparsifier"] == "toptheta", "granularity"].dropna().nunique() >= 2:
            out.append(group)
    return out


def granularity_table(summary: pd.DataFrame, *, model: str, task: str, metric: str, num_fewshot: Any = ANY,
                      limit: Any = ANY) -> pd.DataFrame:
    """Top-θ runs by calibration granularity (coarse to fine), then series and k, the baseline first.

    Only series (sparsifier, placement, compensation) run at two or more granularities are listed.
    """
    table = tradeoff_table(summary, model=model, task=task, metric=metric, num_fewshot=num_fewshot, limit=limit)
    theta = table[(table["sparsifier"] == "toptheta") & table["granularity"].notna()].copy()
    theta["series"] = [series_label(r, granularity=False) for r in theta.to_dict("records")]
    theta = theta[theta.groupby("series")["granularity"].transform("nunique") >= 2]  # only what was ablated
    theta = theta.sort_values(["granularity", "series", "k"], key=sort_key, kind="stable")
    baseline = table[table["series"] == "Baseline"]
    return pd.concat([baseline, theta]).reset_index(drop=True)


def granularity_figure(summary: pd.DataFrame, *, model: str, task: str, metric: str, num_fewshot: Any = ANY,
                       limit: Any = ANY) -> Figure:
    """Bars per granularity: the metric (left, with stderr and the baseline line) and the kept fraction (right)."""
    table = granularity_table(summary, model=model, task=task, metric=metric, num_fewshot=num_fewshot, limit=limit)
    baseline, theta = table[table["series"] == "Baseline"], table[table["series"] != "Baseline"]
    grans = list(dict.fromkeys(theta["granularity"]))
    bars = list(dict.fromkeys(zip(theta["series"], theta["k"])))
    width = 0.8 / max(len(bars), 1)
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax_m, ax_x = fig.subplots(1, 2)
    cmap = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
    for i, (series, k) in enumerate(bars):
        rows = theta[(theta["series"] == series) & (theta["k"] == k)].drop_duplicates("granularity", keep="last")
        rows = rows.set_index("granularity").reindex(grans)
        pos = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(grans))]
        label = f"{series}, k={k}"
        ax_m.bar(pos, rows["value"], width, yerr=rows["stderr"].fillna(0.0), capsize=2,
                 color=cmap[i % len(cmap)], label=label)
        ax_x.bar(pos, rows["kept_attention_fraction"], width, color=cmap[i % len(cmap)], label=label)
    if not baseline.empty:
        ax_m.axhline(baseline["value"].iloc[0], color="black", ls="--", lw=1.2, label="Baseline")
    for ax, ylabel in ((ax_m, full_metric(metric).split(",")[0]), (ax_x, X_LABELS["kept_attention_fraction"])):
        ax.set_xticks(range(len(grans)), grans)
        ax.set_xlabel("θ granularity")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    ax_m.legend(fontsize=7, loc="lower left")
    fig.suptitle(group_title(model, task, full_metric(metric), *setting_of(table)), fontsize=9)
    return fig
