"""Library objects from a run's plain settings: the sparsifier and its compensations, and the checks that need them.

``pipeline`` (run.py), ``toptheta-eval`` (evaluation/lm_eval_model.py) and matched-sparsity resolution (matched.py)
build through these, so a setting means the same thing from every entry point.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from .compensation import check_compensation
from .registry import active_compensations, compensation_kinds, sparsifier_kind

log = logging.getLogger("toptheta")


def needs_thresholds(sparsifier: dict, comp: dict) -> bool:
    """The run needs calibrated thresholds: its sparsifier's own (Top-θ), or a compensation's (calibrated SDC)."""
    return sparsifier_kind(sparsifier["name"]).needs_thresholds or any(
        kind.active(comp) and kind.needs_thresholds(comp) for kind in compensation_kinds())


def searched_parameter(sparsifier: dict):
    """What ``sparsifier.target_kept`` fits, as a ``registry.Parameter``: the rule's own (top-p's p, skip-softmax's λ,
    Top-ρ's ρ), Top-ρ's ρ for Top-θ calibrated to Top-ρ (``sparsifier.budget=toprho``: each ρ tried is a
    calibration), or None: the budget k."""
    if sparsifier.get("name") == "toptheta" and sparsifier.get("budget") == "toprho":
        return sparsifier_kind("toprho").parameter
    return sparsifier_kind(sparsifier["name"]).parameter


def resolve_placement(sparsifier: dict, comp: dict) -> str | None:
    """The placement a run selects at: None for dense; auto is pre when a compensation on prefers it (SDC), else post."""
    if not sparsifier_kind(sparsifier["name"]).drops:
        return None
    placement = sparsifier.get("placement") or "auto"  # pre | post | auto (config.check allows nothing else)
    if placement == "auto":
        return "pre" if any(kind.prefers == "pre" for kind in active_compensations(comp)) else "post"
    return placement


def check_combination(name: str, placement: str | None, comp: dict) -> None:
    """Build the compensation objects against a stand-in sparsifier: the library's own checks speak."""
    if not sparsifier_kind(name).drops:
        return
    stand_in = SimpleNamespace(placement=placement)
    if needs_thresholds({"name": name}, comp):
        stand_in.thresholds = SimpleNamespace(sdc_mass=True)
    check_compensation(stand_in, compensation_objects(comp, thresholds=stand_in.__dict__.get("thresholds")))


def check_sparsifies(sparsifier: dict, num_layers: int, longest_row: int | None, model_name: str,
                     num_heads: int | None = None) -> None:
    """Refuse a sparse run that cannot drop anything (every layer's k is at least the longest possible row), or whose
    settings do not fit the model (the rule's own check_model: Top-ρ's head_weights, one weight per query head).

    Called once the model's depth is known, before it evaluates. Also warns when `layer_k` names every
    layer, so the global `sparsifier.k` applies to none.
    """
    kind = sparsifier_kind(sparsifier["name"])
    if not kind.drops:
        return
    kind.check_model(sparsifier, num_layers, num_heads, model_name)
    layer_k = sparsifier.get("layer_k") or {}
    beyond = sorted(layer for layer in layer_k if not 0 <= int(layer) < num_layers)
    if beyond:
        raise ValueError(
            f"sparsifier.layer_k={layer_k} names layer(s) {beyond}, but {model_name} has {num_layers} layers "
            f"(0..{num_layers - 1}). Drop them from sparsifier.layer_k, e.g. "
            f"sparsifier.layer_k={{{','.join(f'{l}:{k}' for l, k in layer_k.items() if int(l) < num_layers)}}}")
    ks = [layer_k.get(layer, sparsifier["k"] or 1) for layer in range(num_layers)]  # target_kept: k resolved later
    if longest_row is not None and min(ks) >= longest_row:
        raise ValueError(
            f"nothing would be sparsified: {model_name} has {num_layers} layers and every one keeps k >= "
            f"{longest_row} keys (sparsifier.k={sparsifier['k']}, sparsifier.layer_k={layer_k}), while no row is "
            f"longer than {longest_row} tokens. Lower sparsifier.k, or free layers from layer_k "
            f"(sparsifier.layer_k=null, or a model with more than {len(layer_k)} layers)"
        )
    if all(layer in layer_k for layer in range(num_layers)):
        log.warning("sparsifier.layer_k=%s sets k for all %d layers of %s, so sparsifier.k=%s applies to none; "
                    "sparsifier.layer_k=null applies it everywhere", layer_k, num_layers, model_name, sparsifier["k"])


def compensation_objects(comp: dict, thresholds=None) -> list:
    """The compensations comp switches on, in registration order (SDC before VMC)."""
    built = (kind.build(comp, thresholds) for kind in compensation_kinds())
    return [c for c in built if c is not None]


def build_sparsifier(sparsifier: dict, thresholds=None):
    return sparsifier_kind(sparsifier["name"]).build(sparsifier, thresholds)
