"""Library objects from a run's plain settings: the sparsifier and its compensations, and the checks that need them.

``pipeline`` (run.py), ``toptheta-eval`` (evaluation/lm_eval_model.py) and matched-sparsity resolution (matched.py)
build through these, so a setting means the same thing from every entry point.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

log = logging.getLogger("toptheta")


def check_combination(name: str, placement: str | None, comp: dict) -> None:
    """Build the compensation objects against a stand-in sparsifier: the library's own checks speak."""
    from .compensation import check_compensation

    if name == "dense":
        return
    stand_in = SimpleNamespace(placement=placement)
    if name == "toptheta" or comp.get("sdc") == "calibrated":
        stand_in.thresholds = SimpleNamespace(sdc_mass=True)
    check_compensation(stand_in, compensation_objects(comp, thresholds=stand_in.__dict__.get("thresholds")))


def check_sparsifies(sparsifier: dict, num_layers: int, longest_row: int | None, model_name: str) -> None:
    """Refuse a sparse run that cannot drop anything: every layer's k is at least the longest possible row.

    Called once the model's depth is known, before it evaluates. Also warns when `layer_k` names every
    layer, so the global `sparsifier.k` applies to none.
    """
    if sparsifier["name"] == "dense":
        return
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
    from .compensation import SDC, VMC

    out = []
    if comp.get("sdc"):
        out.append(SDC(comp["sdc"], scale=float(comp.get("sdc_scale", 1.0)), thresholds=thresholds))
    if comp.get("vmc"):
        out.append(VMC())
    return out


def build_sparsifier(sparsifier: dict, thresholds=None):
    from . import Dense, SkipSoftmax, TopK, TopP, TopTheta

    if sparsifier["name"] == "dense":
        return Dense()
    if sparsifier["name"] == "topk":
        return TopK(sparsifier["k"], sparsifier["placement"], sparsifier.get("layer_k"))
    if sparsifier["name"] == "topp":
        return TopP(sparsifier["p"], sparsifier["placement"], sparsifier.get("k"), sparsifier.get("layer_k"))
    if sparsifier["name"] == "skipsoftmax":
        return SkipSoftmax(sparsifier["lam"], sparsifier["placement"], sparsifier.get("k"), sparsifier.get("layer_k"))
    return TopTheta(thresholds, sparsifier["placement"], empty_rows=sparsifier.get("empty_rows") or "keep-max")
