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

import json
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from ..registry import SPARSIFIERS
from ..store.rows import SUMMARY_FIELD_PATHS, comp_label
from ..store.runs import DONE_MARKER
from ..store.samples import read_samples, samples_path

DEFAULT_GRANULARITY = "layer-head-n"  # the paper's: one θ per (layer, head, row length)
GRANULARITY_ORDER = ("layer", "layer-n", "layer-head", "layer-head-n")  # coarse to fine
# rouge_score: lm-eval's LongBench Rouge-L; rouge_l, qa_f1: our former LongBench loop's (older runs);
# score: lm-eval's LongBench metric of any subset.
PREFERRED_METRICS = ("acc_norm,none", "pass@1,none", "rouge_score,none", "rouge_l,none", "qa_f1,none", "accuracy,none",
                     "acc,none", "score,none")
SERIES_ORDER = ("Baseline", "Top-θ pre (+SDC +VMC)", "Top-θ post (+VMC)", "Top-k pre (+SDC +VMC)", "Top-k post (+VMC)")
SERIES_COLORS = dict(zip(SERIES_ORDER, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red")))
OTHER_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "gold", "navy", "teal",
                "magenta")
X_LABELS = {"kept_attention_fraction": "kept attention elements (fraction)",
            "kept_vrow_fraction": "kept V rows (fraction)"}
NUMERIC = ("k", "num_fewshot", "limit", "value", "stderr", "kept_attention_fraction", "kept_vrow_fraction",
           "sigma_add", "calib_documents", "clamped_rows", "empty_row_count", "generated_tokens", "target_kept",
           "calib_seed", "kept_attention_fraction_sparsified")
TABLE_COLUMNS = ["model", "task", "num_fewshot", "limit", "metric", "series", "k", "kept_attention_fraction",
                 "kept_vrow_fraction", "value", "stderr", "value_pm_stderr", "attention_reduction",
                 "vrow_reduction", "sparsifier", "placement", "comp", "granularity", "layer_k", "calib_task",
                 "calib_documents", "calib_statistic", "sigma_add", "tac", "calib_compensation", "empty_rows",
                 "empty_row_count", "clamped_rows", "generated_tokens", "target_kept", "calib_seed",
                 "fewshot_sampler", "kept_attention_fraction_sparsified", "run_id"]
EQUIVALENT_SERIES = {"Top-k post (+VMC)": "Top-k post (+VMC) ≡ pre (+SDC +VMC)",
                     "Top-k post": "Top-k post ≡ pre (+SDC)"}  # the same computation (method.md §3.2)

_ANY: Any = object()  # "whichever single setting the data holds" for num_fewshot / limit


# ---------------------------------------------------------------- labels and selection


def _text(value: Any) -> str:
    """A summary cell as text: '' for None/NaN/empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value).strip()


def _comp_parts(comp: str) -> list[str]:
    """`sdc=exact+vmc` -> ['SDC', 'VMC']; a non-exact estimator or a scale is shown: 'SDC[calibrated]'."""
    parts = []
    for part in filter(None, comp.split("+")):
        if part == "none":
            continue
        if part.startswith("sdc="):
            how = part[4:].replace("*", "×")
            parts.append("SDC" if how == "exact" else f"SDC[{how}]")
        else:
            parts.append(part.upper())
    return parts


def sparsifier_label(name) -> str:
    """How tables and figures name a sparsifier: its registered label (Top-k, Top-θ, ...), else the stored name."""
    return SPARSIFIERS.get(name).label if name in SPARSIFIERS else str(name)


def series_label(row: Mapping[str, Any], *, granularity: bool = True) -> str:
    """The paper's legend label of a summary row, e.g. 'Top-θ pre (+SDC +VMC)' or 'Baseline'.

    Top-θ runs calibrated at a granularity other than DEFAULT_GRANULARITY get it appended
    ('Top-θ post (+VMC) [θ per layer]') unless `granularity=False`, so distinct configurations
    never merge into one series.
    """
    name = _text(row.get("sparsifier"))
    if name in ("", "dense"):
        return "Baseline"
    label = " ".join(filter(None, (sparsifier_label(name), _text(row.get("placement")))))
    comps = _comp_parts(_text(row.get("comp")))
    if comps:
        label += " (" + " ".join(f"+{c}" for c in comps) + ")"
    gran = _text(row.get("granularity"))
    if granularity and name == "toptheta" and gran and gran != DEFAULT_GRANULARITY:
        label += f" [θ per {gran}]"
    return label + "".join(f" [{tag}]" for tag in setting_tags(row))


def setting_tags(row: Mapping[str, Any], skip: Sequence[str] = ()) -> list[str]:
    """Tags for settings that differ from the paper's protocol, so distinct configurations never merge:
    a cross-dataset calibration ('cal. arc_challenge', the paper's "Top-θ(cal.arcc)"), no larger k for
    layers 0-1, another calibration statistic, σ_add, no TAC, the reference code's empty-row rule.
    The number of calibration documents is tagged by the tables that compare it (calib_documents column)."""
    if _text(row.get("sparsifier")) in ("", "dense"):
        return []
    tags = []
    task, calib_task = _text(row.get("task")), _text(row.get("calib_task"))
    if calib_task and task and "calib_task" not in skip and calib_task != task \
            and not task.startswith(calib_task + "_"):
        tags.append(f"cal. {calib_task}")
    if _text(row.get("layer_k")) == "none" and "layer_k" not in skip:
        tags.append("layers 0-1 at k")
    statistic = _text(row.get("calib_statistic"))
    if statistic and statistic != "order" and "calib_statistic" not in skip:
        tags.append(statistic)
    sigma = _text(row.get("sigma_add"))
    if sigma and "sigma_add" not in skip and _float(sigma) not in (None, 0.1):
        tags.append(f"σ={_float(sigma):g}")
    if _text(row.get("tac")).lower() == "false" and "tac" not in skip:
        tags.append("no TAC")
    if _text(row.get("empty_rows")) == "reference" and "empty_rows" not in skip:
        tags.append("empty rows as [R]")
    return tags


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _series_key(label: str) -> tuple[int, str]:
    return (SERIES_ORDER.index(label) if label in SERIES_ORDER else len(SERIES_ORDER), label)


def series_colors(labels: Sequence[str]) -> dict[str, str]:
    """Fixed colours for the paper's five series, the rest in a stable order of their own."""
    others = sorted(set(labels) - set(SERIES_COLORS))
    return {**SERIES_COLORS, **{lab: OTHER_COLORS[i % len(OTHER_COLORS)] for i, lab in enumerate(others)}}


def _full_metric(metric: str) -> str:
    return metric if "," in metric else f"{metric},none"  # 'acc_norm' -> lm-eval's 'acc_norm,none'


def latest(summary: pd.DataFrame) -> pd.DataFrame:
    """The latest row per (run_id, task, metric), numeric columns as numbers.

    Reruns (force=true) append rows with the same run_id; the later timestamp wins, ties keep file order.
    """
    df = summary.copy()
    for col in NUMERIC:
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    if "timestamp" in df:
        df = df.sort_values("timestamp", kind="stable", na_position="first")
    return df.drop_duplicates(["run_id", "task", "metric"], keep="last").sort_index()


def _is(df: pd.DataFrame, col: str, value: Any) -> pd.Series:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return df[col].isna() if missing else df[col] == value


def _select(summary: pd.DataFrame, model: str, task: str, metric: str, num_fewshot: Any, limit: Any) -> pd.DataFrame:
    """Latest rows of one (model, task, metric, num_fewshot, limit); fails if the setting is ambiguous."""
    df = latest(summary)
    df = df[(df["model"] == model) & (df["task"] == task) & (df["metric"] == _full_metric(metric))]
    if num_fewshot is not _ANY:
        df = df[_is(df, "num_fewshot", num_fewshot)]
    if limit is not _ANY:
        df = df[_is(df, "limit", limit)]
    settings = df[["num_fewshot", "limit"]].drop_duplicates()
    if len(settings) > 1:
        choices = "; ".join(f"num_fewshot={_num(a)}, limit={_num(b)}" for a, b in settings.itertuples(index=False))
        raise ValueError(f"{model} / {task} was evaluated in several settings ({choices}); "
                         "pass num_fewshot= and limit= (None = whole split) to choose one")
    return df


def _num(value: Any) -> Any:
    """64.0 -> 64, NaN -> None (for labels and file names)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value) if float(value).is_integer() else value


def metric_of_interest(summary: pd.DataFrame, task: str) -> str | None:
    """The metric a task is judged by: acc_norm (QA), pass@1 (HumanEval), Rouge-L (LongBench), accuracy (passkey)."""
    present = set(summary.loc[summary["task"] == task, "metric"])
    return next((m for m in PREFERRED_METRICS if m in present), None)


def tradeoff_groups(summary: pd.DataFrame) -> list[dict[str, Any]]:
    """Every (model, task, metric of interest, num_fewshot, limit) with a dense baseline and a sparse run.

    Each item holds the keyword arguments of tradeoff_table / tradeoff_figure.
    """
    df = latest(summary)
    groups = []
    for (model, task, fewshot, limit), rows in df.groupby(["model", "task", "num_fewshot", "limit"], dropna=False):
        metric = metric_of_interest(df, task)
        rows = rows[rows["metric"] == metric]
        dense = rows["sparsifier"].fillna("dense").eq("dense")
        if dense.any() and (~dense).any():
            groups.append({"model": model, "task": task, "metric": metric, "num_fewshot": _num(fewshot),
                           "limit": _num(limit)})
    return sorted(groups, key=lambda g: (g["model"], g["task"], str(g["num_fewshot"]), str(g["limit"])))


def group_title(model: str, task: str, metric: str, num_fewshot: Any = None, limit: Any = None) -> str:
    setting = ", ".join(filter(None, (f"{_num(num_fewshot)}-shot" if _num(num_fewshot) is not None else "",
                                      f"limit {_num(limit)}" if _num(limit) is not None else "")))
    return f"{model} · {task}" + (f" ({setting})" if setting else "") + f" · {metric.split(',')[0]}"


# ---------------------------------------------------------------- accuracy vs kept fraction


def tradeoff_table(summary: pd.DataFrame, *, model: str, task: str, metric: str, num_fewshot: Any = _ANY,
                   limit: Any = _ANY) -> pd.DataFrame:
    """The numbers behind tradeoff_figure: one row per run, the baseline first.

    Series in legend order, then k. The baseline is the latest dense run of the setting.
    attention_reduction = 1 / kept_attention_fraction and vrow_reduction = 1 / kept_vrow_fraction
    (method.md §5: the reduction factor is 1/x).
    """
    df = _select(summary, model, task, metric, num_fewshot, limit)
    if df.empty:
        return pd.DataFrame(columns=TABLE_COLUMNS)
    df = df.assign(series=[series_label(r) for r in df.to_dict("records")])
    docs = df.loc[df["sparsifier"] == "toptheta", "calib_documents"].dropna() if "calib_documents" in df else []
    if len(docs) and docs.nunique() > 1:  # calibration-set sizes other than the usual one are their own series
        usual = docs.value_counts().sort_index(ascending=False).idxmax()
        other = (df["sparsifier"] == "toptheta") & df["calib_documents"].notna() & (df["calib_documents"] != usual)
        df.loc[other, "series"] = [f"{s} [{_num(d)} cal. docs]" for s, d in zip(df.loc[other, "series"],
                                                                              df.loc[other, "calib_documents"])]
    dense = df[df["series"] == "Baseline"]
    if "timestamp" in dense:
        dense = dense.sort_values("timestamp", kind="stable", na_position="first")
    df = pd.concat([dense.tail(1), df[df["series"] != "Baseline"]])
    df["attention_reduction"] = 1.0 / df["kept_attention_fraction"]
    df["vrow_reduction"] = 1.0 / df["kept_vrow_fraction"]
    df["value_pm_stderr"] = [_pm(v, s) for v, s in zip(df["value"], df["stderr"])]
    df["k"] = df["k"].astype("Int64")
    df = df.sort_values(["series", "k", "kept_attention_fraction"], key=_sort_key, kind="stable")
    for col in TABLE_COLUMNS:
        if col not in df:
            df[col] = None
    return df[TABLE_COLUMNS].reset_index(drop=True)


GENERATION_METRICS = ("pass@1,none", "rouge_score,none", "rouge_l,none", "qa_f1,none", "accuracy,none")


def generation_glance(summary: pd.DataFrame) -> pd.DataFrame:
    """The generation tasks at a glance: every run of each (model, task) on its most documents, one row each.

    A task counts as generation when the metric it is judged by is one of GENERATION_METRICS (HumanEval,
    LongBench, passkey and its per-length sub-tasks). Kept fractions and generated tokens as the store has them;
    "rows past calibration": the attention rows of a Top-θ run longer than its thresholds' calibrated length,
    which used the last calibrated θ (calibrating on short documents, e.g. ARC questions, for long prompts clamps
    many).
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


def _sort_key(col: pd.Series) -> pd.Series:
    """sort_values key: series in legend order, granularities coarse to fine, other columns as they are."""
    if col.name == "series":
        ranked = sorted(col.dropna().unique(), key=_series_key)
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


def main_series(series: str) -> bool:
    """Whether a series is one of the paper's curves (no ablation tag such as '[θ per layer]'); a
    cross-dataset calibration ('[cal. arc_challenge]', the paper's "Top-θ(cal.arcc)") is one too."""
    tags = [t for t in series.split(" [")[1:]]
    return all(t.startswith("cal. ") for t in tags)


def label_log_axis(axis) -> None:
    """Plain labels at 1-2-5 steps on a log axis (0.05, 0.1, 0.2, ...).

    Over less than a decade, as most kept fractions span, matplotlib labels one major tick or labels the minor
    ones as 2×10⁻¹; minor ticks stay for the grid, unlabelled.
    """
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def tradeoff_figure(summary: pd.DataFrame, *, model: str, task: str, metric: str,
                    x: str = "kept_attention_fraction", num_fewshot: Any = _ANY, limit: Any = _ANY,
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
    ax.set_ylabel(_full_metric(metric).split(",")[0])
    ax.set_title("Top-θ and Top-k (SDC, VMC): " + group_title(model, task, _full_metric(metric), *_setting(table)),
                 fontsize=8)
    ax.grid(alpha=0.3, which="both")
    if crowded:
        fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="outside lower center", ncols=2)
    else:
        ax.legend(fontsize=7, loc="best")
    return fig


def _setting(table: pd.DataFrame) -> tuple[Any, Any]:
    if table.empty:
        return None, None
    return table["num_fewshot"].iloc[0], table["limit"].iloc[0]


# ---------------------------------------------------------------- threshold granularity ablation


def granularity_groups(summary: pd.DataFrame) -> list[dict[str, Any]]:
    """The trade-off groups whose Top-θ runs span at least two calibration granularities."""
    out = []
    for group in tradeoff_groups(summary):
        rows = _select(summary, **group)
        if rows.loc[rows["sparsifier"] == "toptheta", "granularity"].dropna().nunique() >= 2:
            out.append(group)
    return out


def granularity_table(summary: pd.DataFrame, *, model: str, task: str, metric: str, num_fewshot: Any = _ANY,
                      limit: Any = _ANY) -> pd.DataFrame:
    """Top-θ runs by calibration granularity (coarse to fine), then series and k, the baseline first.

    Only series (sparsifier, placement, compensation) run at two or more granularities are listed.
    """
    table = tradeoff_table(summary, model=model, task=task, metric=metric, num_fewshot=num_fewshot, limit=limit)
    theta = table[(table["sparsifier"] == "toptheta") & table["granularity"].notna()].copy()
    theta["series"] = [series_label(r, granularity=False) for r in theta.to_dict("records")]
    theta = theta[theta.groupby("series")["granularity"].transform("nunique") >= 2]  # only what was ablated
    theta = theta.sort_values(["granularity", "series", "k"], key=_sort_key, kind="stable")
    baseline = table[table["series"] == "Baseline"]
    return pd.concat([baseline, theta]).reset_index(drop=True)


def granularity_figure(summary: pd.DataFrame, *, model: str, task: str, metric: str, num_fewshot: Any = _ANY,
                       limit: Any = _ANY) -> Figure:
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
    for ax, ylabel in ((ax_m, _full_metric(metric).split(",")[0]), (ax_x, X_LABELS["kept_attention_fraction"])):
        ax.set_xticks(range(len(grans)), grans)
        ax.set_xlabel("θ granularity")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    ax_m.legend(fontsize=7, loc="lower left")
    fig.suptitle(group_title(model, task, _full_metric(metric), *_setting(table)), fontsize=9)
    return fig


# ---------------------------------------------------------------- per-layer statistics


def config_row(config: Mapping[str, Any]) -> dict[str, Any]:
    """The summary columns a run config determines (model, sparsifier, placement, k, comp, granularity, ...)."""
    row = {}
    for column, paths in SUMMARY_FIELD_PATHS.items():
        for path in paths:
            node: Any = config
            for part in path.split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            if node is not None:
                row[column] = comp_label(node) if isinstance(node, Mapping) and column == "comp" else node
                break
    return row


def runs_table(results_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """One row per complete run directory (DONE present): run_id, path, config columns, series, task_name,
    and has_layers (whether its stats.json holds per-layer lists)."""
    rows = []
    for run_dir in sorted(Path(results_dir, "runs").glob("*/")):
        if not (run_dir / DONE_MARKER).is_file() or not (run_dir / "config.json").is_file():
            continue
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        row = config_row(config)
        task = config.get("task")
        row.setdefault("task", task.get("lm_eval_task") or task.get("name") if isinstance(task, Mapping) else task)
        rows.append({"run_id": run_dir.name, "path": str(run_dir), **row, "series": series_label(row),
                     "task_name": task.get("name") if isinstance(task, Mapping) else task,
                     "has_layers": bool(_layer_stats(run_dir))})
    return pd.DataFrame(rows, columns=["run_id", "path", *SUMMARY_FIELD_PATHS, "task", "series", "task_name",
                                       "has_layers"])


def per_layer_groups(results_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Sparse runs with per-layer statistics, grouped by (model, task, series) and sorted by k.

    Each item: model, task, series, title, run_dirs (the argument of per_layer_figure / per_layer_table).
    Dense runs are left out: they keep everything in every layer.
    """
    runs = runs_table(results_dir)
    runs = runs[(runs["series"] != "Baseline") & runs["has_layers"].astype(bool)]
    groups = []
    for (model, task, series), rows in runs.groupby(["model", "task_name", "series"], dropna=False, sort=True):
        rows = rows.assign(k=pd.to_numeric(rows["k"], errors="coerce")).sort_values("k", kind="stable")
        groups.append({"model": model, "task": task, "series": series, "title": f"{model} · {task} · {series}",
                       "run_dirs": list(rows["path"])})
    return groups


def _layer_stats(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The per-layer lists of a run's stats.json ({} when it has none).

    Runs store them under "per_layer"; runs written before that kept them at the top level, where
    they had replaced the scalar fractions of the same names.
    """
    path = Path(run_dir) / "stats.json"
    stats = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    layers = stats.get("per_layer", stats)
    return layers if isinstance(layers, dict) and isinstance(layers.get("layer"), list) else {}


def run_label(run_dir: str | os.PathLike[str]) -> str:
    """'Top-θ post (+VMC), k=64' from a run directory's config.json (its run id when there is none)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return Path(run_dir).name
    row = config_row(json.loads(path.read_text(encoding="utf-8")))
    k = _num(row.get("k"))
    return series_label(row) + (f", k={k}" if k is not None else "")


def per_layer_table(run_dirs: Sequence[str | os.PathLike[str]], labels: Sequence[str] | None = None) -> pd.DataFrame:
    """Long format: run_id, label, layer, kept_attention_fraction, kept_vrow_fraction, mean_dropped_mass.

    Read from each run's stats.json (the per-layer lists SparsityStats.per_layer writes); runs
    without them are skipped.
    """
    frames = []
    for i, run_dir in enumerate(run_dirs):
        stats = _layer_stats(run_dir)
        if not stats:
            continue
        frame = pd.DataFrame({"layer": stats["layer"]})
        for col in ("kept_attention_fraction", "kept_vrow_fraction", "mean_dropped_mass"):
            values = stats.get(col)
            frame[col] = pd.to_numeric(pd.Series(values if isinstance(values, list) else [None] * len(frame)),
                                       errors="coerce")
        frame.insert(0, "label", labels[i] if labels else run_label(run_dir))
        frame.insert(0, "run_id", Path(run_dir).name)
        frames.append(frame)
    columns = ["run_id", "label", "layer", "kept_attention_fraction", "kept_vrow_fraction", "mean_dropped_mass"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def per_layer_figure(run_dirs: Sequence[str | os.PathLike[str]], *, stat: str = "kept_attention_fraction",
                     labels: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """`stat` per layer from each run's stats.json, one line per run."""
    table = per_layer_table(run_dirs, labels)
    if table.empty:
        raise ValueError(f"none of the {len(run_dirs)} run directories has per-layer lists in stats.json")
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    for (_, label), rows in table.groupby(["run_id", "label"], sort=False):
        ax.plot(rows["layer"], rows[stat], marker="o", ms=3, lw=1.2, label=label)
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(X_LABELS.get(stat, stat))
    ax.set_ylim(0, 1.05 if stat in X_LABELS else None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def vrow_popularity_records(results_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Runs that recorded V-row popularity (task.vrow_popularity): run_id, model, task, label and the record
    (layer, group, heads_per_group, steps, counts), sorted by model, label and layer."""
    records = []
    runs = runs_table(results_dir)
    for row in runs.itertuples(index=False):
        path = Path(row.path) / "stats.json"
        record = json.loads(path.read_text(encoding="utf-8")).get("vrow_popularity") if path.is_file() else None
        if isinstance(record, dict) and record.get("counts"):
            records.append({"run_id": row.run_id, "model": row.model, "task": row.task_name,
                            "label": run_label(row.path), "record": record, "problem": _first_problem(row.path)})
    return sorted(records, key=lambda r: (str(r["model"]), r["label"], r["record"]["layer"], r["run_id"]))


def _first_problem(run_dir: str | os.PathLike[str]) -> str | None:
    """The id of a run's first generation (its first sample: HumanEval's task_id, passkey's id), which a V-row
    popularity recording follows; None without samples."""

    path = samples_path(run_dir)
    samples = read_samples(path) if path is not None else None
    if isinstance(samples, Mapping):
        samples = next(iter(samples.values()), None)
    first = samples[0] if isinstance(samples, list) and samples and isinstance(samples[0], Mapping) else {}
    problem = next((first[k] for k in ("task_id", "id", "doc_id") if k in first), None)
    return None if problem is None else str(problem)


def vrow_popularity_table(records: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Per record: how far the union of a group's kept V rows exceeds one head's kept set (the decode cost).

    Means over decode steps of: keys, V rows read (kept by any head of the group), V rows kept per head, and
    their ratio (1 = the heads keep the same rows; heads per group = disjoint sets)."""
    rows = []
    for item in records:
        rec = item["record"]
        heads = rec.get("heads_per_group") or 1
        keys, union, per_head = [], [], []
        for step, counts in enumerate(rec["counts"]):
            width = len(counts) - (len(rec["counts"]) - 1 - step)  # step i saw i + 1 fewer keys than the last
            keys.append(width)
            union.append(sum(1 for c in counts if c > 0))
            per_head.append(sum(counts) / heads)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        rows.append({"model": item["model"], "task": item["task"], "problem": item.get("problem"),
                     "series": item["label"], "layer": rec["layer"],
                     "group": rec["group"], "heads_per_group": heads, "decode_steps": len(keys),
                     "mean_keys": mean(keys), "mean_vrows_read": mean(union), "mean_vrows_per_head": mean(per_head),
                     "union_over_per_head": mean(union) / mean(per_head) if mean(per_head) else math.nan,
                     "run_id": item["run_id"]})
    return pd.DataFrame(rows)


def vrow_popularity_figure(record: Mapping[str, Any], *, title: str | None = None) -> Figure:
    """Heatmap: decode step × key position, colour = query heads of the KV group keeping that V row; grey: keys
    that did not exist yet at that step (each step of the generation sees one key more than the last)."""
    import matplotlib

    counts = np.asarray(record["counts"], dtype=float)
    if counts.ndim == 2 and counts.size:
        steps, width = counts.shape
        first = width - (steps - 1)  # keys seen by the first step
        future = np.arange(width)[None, :] >= first + np.arange(steps)[:, None]
        counts = np.ma.masked_array(counts, mask=future)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", cmap=cmap,
                      vmin=0, vmax=record.get("heads_per_group") or None)
    fig.colorbar(image, ax=ax, label="query heads keeping the V row")
    ax.set_xlabel("key position")
    ax.set_ylabel("decode step")
    ax.set_title("\n".join(textwrap.wrap(title or f"layer {record['layer']}, KV group {record['group']}", width=95)),
                 fontsize=8.5)
    return fig


def results_dir_from_env(default: str = "results") -> Path:
    """$TOPTHETA_RESULTS_DIR, else `default`; a relative path missing here is looked up in the parent directory
    (a notebook runs in notebooks/, the results live at the repository root)."""
    path = Path(os.environ.get("TOPTHETA_RESULTS_DIR") or default)
    if not path.is_absolute() and not path.exists() and (Path.cwd().parent / path).exists():
        return Path.cwd().parent / path
    return path
