"""How tables and figures name things: sparsifiers, series (the paper's legend labels), their colours.

A series label is built from a summary row: sparsifier, placement, compensation, plus tags for any setting
that differs from the paper's protocol, so distinct configurations never merge into one curve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .. import registry
from . import regimes

DEFAULT_GRANULARITY = "layer-head-n"  # the paper's: one θ per (layer, head, row length)
GRANULARITY_ORDER = ("layer", "layer-n", "layer-head", "layer-head-n")  # coarse to fine
SERIES_ORDER = ("Baseline", "Top-θ pre (+SDC +VMC)", "Top-θ post (+VMC)", "Top-k pre (+SDC +VMC)", "Top-k post (+VMC)")
SERIES_COLORS = dict(zip(SERIES_ORDER, ("black", "tab:blue", "tab:orange", "tab:green", "tab:red")))
OTHER_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "gold", "navy", "teal",
                "magenta")
EQUIVALENT_SERIES = {"Top-k post (+VMC)": "Top-k post (+VMC) ≡ pre (+SDC +VMC)",
                     "Top-k post": "Top-k post ≡ pre (+SDC)"}  # the same computation (method.md §3.2)



def cell_text(value: Any) -> str:
    """A summary cell as text: '' for None/NaN/empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value).strip()


def comp_parts(comp: str) -> list[str]:
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
    return registry.sparsifier_kind(name).label if name in registry.sparsifier_names() else str(name)


def series_label(row: Mapping[str, Any], *, granularity: bool = True) -> str:
    """The paper's legend label of a summary row, e.g. 'Top-θ pre (+SDC +VMC)' or 'Baseline'.

    Top-θ runs calibrated at a granularity other than DEFAULT_GRANULARITY get it appended
    ('Top-θ post (+VMC) [θ per layer]') unless `granularity=False`, so distinct configurations
    never merge into one series.
    """
    name = cell_text(row.get("sparsifier"))
    if name in ("", "dense"):
        return "Baseline"
    label = " ".join(filter(None, (sparsifier_label(name), cell_text(row.get("placement")))))
    comps = comp_parts(cell_text(row.get("comp")))
    if comps:
        label += " (" + " ".join(f"+{c}" for c in comps) + ")"
    gran = cell_text(row.get("granularity"))
    if granularity and name == "toptheta" and gran and gran != DEFAULT_GRANULARITY:
        label += f" [θ per {gran}]"
    return label + "".join(f" [{tag}]" for tag in setting_tags(row))


def setting_tags(row: Mapping[str, Any], skip: Sequence[str] = ()) -> list[str]:
    """Tags for settings that differ from the paper's protocol, so distinct configurations never merge:
    a cross-dataset calibration ('cal. arc_challenge', the paper's "Top-θ(cal.arcc)"), no larger k for
    layers 0-1, a budget per layer (layer_k past layers 0-1), another calibration statistic, σ_add, no TAC, the
    reference code's empty-row rule, Top-θ calibrated to Top-ρ, θ extrapolated past the calibrated lengths
    (calib.beyond=fit), Top-ρ's shares per head (with their weights' digest).
    The number of calibration documents is tagged by the tables that compare it (calib_documents column)."""
    if cell_text(row.get("sparsifier")) in ("", "dense"):
        return []
    tags = []
    task, calib_task = cell_text(row.get("task")), cell_text(row.get("calib_task"))
    if calib_task and task and "calib_task" not in skip and calib_task != task \
            and not task.startswith(calib_task + "_"):
        tags.append(f"cal. {calib_task}")
    if cell_text(row.get("layer_k")) == "none" and "layer_k" not in skip:
        tags.append("layers 0-1 at k")
    elif per_layer_budget(row.get("layer_k")) and "layer_k" not in skip:
        tags.append(PER_LAYER_K)
    statistic = cell_text(row.get("calib_statistic"))
    if statistic and statistic != "order" and "calib_statistic" not in skip:
        tags.append(statistic)
    sigma = cell_text(row.get("sigma_add"))
    if sigma and "sigma_add" not in skip and _float(sigma) not in (None, 0.1):
        tags.append(f"σ={_float(sigma):g}")
    if cell_text(row.get("tac")).lower() == "false" and "tac" not in skip:
        tags.append("no TAC")
    if cell_text(row.get("empty_rows")) == "reference" and "empty_rows" not in skip:
        tags.append("empty rows as [R]")
    if cell_text(row.get("sparsifier")) == "toptheta" and cell_text(row.get("rho")) and "rho" not in skip:
        tags.append(THETA_FOR_RHO)  # calibrated to Top-ρ's kept sets (sparsifier.budget=toprho)
    if cell_text(row.get("sparsifier")) == "toptheta" and cell_text(row.get("calib_beyond")) == "fit" \
            and "calib_beyond" not in skip:
        tags.append(THETA_FIT)
    if cell_text(row.get("head_weights")) and "head_weights" not in skip:  # runs with other weights stay apart
        tags.append(f"{PER_HEAD_RHO} {cell_text(row.get('head_weights'))}")
    if regimes.broke_protocol(row):
        tags.append("rows past calibration")  # a long-row run that broke its protocol (regimes.py): never merged
    return tags


PER_LAYER_K = "per-layer k"  # the tag of a run given a budget per layer (scripts/layer_budget.py)
THETA_FOR_RHO = "θ for Top-ρ"  # the tag of a Top-θ run calibrated to Top-ρ's ⌈ρ·w·n⌉ keys instead of k
THETA_FIT = "θ fitted past calibration"  # the tag of a Top-θ run whose rows past the calibrated lengths took θ from
#   the fitted law (calib.beyond=fit) rather than the longest calibrated row's (clamp, the default)
PER_HEAD_RHO = "per-head ρ"  # the tag of a Top-ρ run given a share per head (scripts/head_budget.py), with the
# weights' digest (store.rows.weights_digest): '[per-head ρ wd0bb00bc]'


def per_layer_budget(layer_k: Any) -> bool:
    """Whether layer_k (a summary cell '0=295,1=56,2=56,...') is more than the paper's larger k for layers 0-1: a
    layer past the first two, or two different values."""
    text = cell_text(layer_k)
    entries = [] if text in ("", "none") else [tuple(entry.split("=", 1)) for entry in text.split(",")]
    return any(layer.strip() not in ("0", "1") for layer, *_ in entries) or len({tuple(k) for _, *k in entries}) > 1


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def series_key(label: str) -> tuple[int, str]:
    return (SERIES_ORDER.index(label) if label in SERIES_ORDER else len(SERIES_ORDER), label)


def series_colors(labels: Sequence[str]) -> dict[str, str]:
    """Fixed colours for the paper's five series, the rest in a stable order of their own."""
    others = sorted(set(labels) - set(SERIES_COLORS))
    return {**SERIES_COLORS, **{lab: OTHER_COLORS[i % len(OTHER_COLORS)] for i, lab in enumerate(others)}}


def main_series(series: str) -> bool:
    """Whether a series is one of the paper's curves (no ablation tag such as '[θ per layer]'); a
    cross-dataset calibration ('[cal. arc_challenge]', the paper's "Top-θ(cal.arcc)") is one too."""
    tags = [t for t in series.split(" [")[1:]]
    return all(t.startswith("cal. ") for t in tags)
