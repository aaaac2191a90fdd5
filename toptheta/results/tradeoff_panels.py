"""Trade-off figures that show the pairs: small multiples of accuracy against the kept fraction, paired bars.

The paper's figure (figures.tradeoff_figure) draws every series in one axes with unpaired ±stderr bars; with nine
series the k labels collide and the bars, about twice the paired uncertainty, hide what the pairs show. Here:

* at most PANEL_SERIES (4) series a panel, panels side by side sharing both axes, each with the dense line and the
  non-inferiority margin (dense − 0.01, dotted);
* each point's bar is the paired 95 % interval of its difference to dense, drawn around its accuracy
  (accuracy ± the paired half-widths; calibration seeds resampled too, comparisons.compare_rows); a run without
  per-question outputs gets the interval from two stderrs, drawn hollow;
* a log-scale kept-fraction axis; k labels placed where they overlap no other label; the legend under each panel,
  off the data; the full setting in the title, wrapped rather than cut.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from . import comparisons, figures, labels, seeds, selection, verdicts

PANEL_SERIES = 4
MARGIN = verdicts.MARGIN
# candidate label offsets in points, tried in order: right-above, right-below, left-above, left-below, further up/down
OFFSETS = ((4, 4), (4, -10), (-14, 4), (-14, -10), (4, 12), (4, -18), (-14, 12), (-14, -18))


def panel_table(summary: pd.DataFrame, *, model: str, task: str, metric: str, x: str = "kept_attention_fraction",
                num_fewshot: Any = selection.ANY, limit: Any = selection.ANY, results_dir: str | Path | None = None,
                series: list[str] | None = None) -> pd.DataFrame:
    """The drawn points: one row per (series, configuration; calibration seeds merged) with its paired difference
    to dense, the interval and how it was computed; the baseline first."""
    table = figures.tradeoff_table(summary, model=model, task=task, metric=metric, num_fewshot=num_fewshot,
                                   limit=limit)
    if table.empty:
        return table.assign(diff=None, ci_low=None, ci_high=None, method=None)
    table = seeds.merge_seeds(table)
    drawn = [s for s in dict.fromkeys(table["series"]) if s == "Baseline"
             or (s in series if series is not None else labels.main_series(s))]
    table = table[table["series"].isin(drawn)].reset_index(drop=True)
    dense = table[table["series"] == "Baseline"]
    results_dir = Path(results_dir) if results_dir is not None else None
    out = []
    for row in table.to_dict("records"):
        row = dict(row, diff=None, ci_low=None, ci_high=None, method=None)
        if row["series"] != "Baseline" and len(dense):
            d, _ = comparisons.compare_rows(pd.Series(row), dense.iloc[0], results_dir)
            row.update(diff=d.diff, ci_low=d.ci_low, ci_high=d.ci_high, method=d.method)
        out.append(row)
    return pd.DataFrame(out)


def _chunks(names: list[str]) -> list[list[str]]:
    """Series in legend order, PANEL_SERIES a panel, panels as even as possible."""
    panels = max(1, math.ceil(len(names) / PANEL_SERIES))
    size = math.ceil(len(names) / panels) if names else 0
    return [names[i:i + size] for i in range(0, len(names), size)] or [[]]


def tradeoff_panels_figure(summary: pd.DataFrame, *, model: str, task: str, metric: str,
                           x: str = "kept_attention_fraction", num_fewshot: Any = selection.ANY, limit: Any = selection.ANY,
                           results_dir: str | Path | None = None, series: list[str] | None = None) -> Figure:
    """The metric against the kept fraction `x`, small multiples of ≤ 4 series with paired bars (module docstring)."""
    if x not in figures.X_LABELS:
        raise ValueError(f"x={x!r}: use one of {', '.join(figures.X_LABELS)}")
    table = panel_table(summary, model=model, task=task, metric=metric, x=x, num_fewshot=num_fewshot, limit=limit,
                        results_dir=results_dir, series=series)
    sparse = table[(table["series"] != "Baseline") & table[x].notna() & (table[x] > 0)] if len(table) else table
    names = list(dict.fromkeys(sparse["series"])) if len(sparse) else []
    panels = _chunks(names)
    colors = labels.series_colors(names)
    ncols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(3.6 * ncols + 0.8, 3.3 * nrows + 1.0), layout="constrained")
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
    dense = table[table["series"] == "Baseline"] if len(table) else table
    lowest = float(sparse[x].min()) if len(sparse) else 0.1
    label = selection.full_metric(metric).split(",")[0]
    for ax, members in zip(axes, panels):
        if len(dense):
            value = float(dense["value"].iloc[0])
            ax.axhline(value, color="black", lw=1.1, ls="--", label="dense")
            ax.axhline(value - MARGIN, color="black", lw=0.8, ls=":", label=f"dense − {MARGIN:g} (margin)")
        for name in members:
            rows = sparse[sparse["series"] == name].sort_values(x)
            paired_rows = rows["method"].fillna("").str.startswith("paired")
            low = (rows["diff"] - rows["ci_low"]).astype(float).clip(lower=0).fillna(0.0)
            high = (rows["ci_high"] - rows["diff"]).astype(float).clip(lower=0).fillna(0.0)
            color = colors[name]
            ax.plot(rows[x], rows["value"], color=color, lw=1.2, label=labels.EQUIVALENT_SERIES.get(name, name))
            for mask, face in ((paired_rows, color), (~paired_rows, "white")):
                if mask.any():
                    ax.errorbar(rows[x][mask], rows["value"][mask], yerr=[low[mask], high[mask]], fmt="o", ms=4,
                                color=color, mfc=face, capsize=3, lw=1.0)
        ax.set_xscale("log")
        ax.set_xlim(lowest / 1.5, 1.3)
        figures.label_log_axis(ax.xaxis)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=1, frameon=False)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, members in zip(axes, panels):
        _label_points(ax, sparse[sparse["series"].isin(members)], x, colors)
    fig.supxlabel(figures.X_LABELS[x] + " (log scale)", fontsize=9)
    fig.supylabel(f"{label} (bars: paired 95 % interval of the difference to dense)", fontsize=8)
    title = "Top-θ and Top-k (SDC, VMC): " + selection.group_title(model, task, selection.full_metric(metric), *selection.setting_of(table))
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(30 * ncols + 20))), fontsize=9)
    return fig


def _label_points(ax, rows: pd.DataFrame, x: str, colors: dict[str, str]) -> None:
    """k beside each point, at the first offset (OFFSETS) whose box overlaps no label or point placed before."""
    if rows.empty:
        return
    ax.get_ylim()  # settle the autoscaled limits before reading positions
    transform = ax.transData
    taken: list[tuple[float, float, float, float]] = []
    data = [(float(a), float(b)) for a, b in zip(rows[x], rows["value"])]
    points = [tuple(transform.transform(p)) for p in data]
    scale = ax.figure.dpi / 72.0  # points to pixels
    for (px, py), xy, k, name in zip(points, data, rows["k"], rows["series"]):
        if pd.isna(k):
            continue
        text = str(int(k))
        w, h = (5.0 * len(text) + 2) * scale, 8.0 * scale
        for dx, dy in OFFSETS:
            box = (px + dx * scale, py + dy * scale, px + dx * scale + w, py + dy * scale + h)
            clear = not any(_overlap(box, other) for other in taken)
            if clear and not any(box[0] - 2 <= qx <= box[2] + 2 and box[1] - 2 <= qy <= box[3] + 2 for qx, qy in points):
                break
        else:  # nowhere free: the first place
            dx, dy = OFFSETS[0]
            box = (px + dx * scale, py + dy * scale, px + dx * scale + w, py + dy * scale + h)
        taken.append(box)
        ax.annotate(text, xy, textcoords="offset points", xytext=(dx, dy), fontsize=6.5, color=colors[name])


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
