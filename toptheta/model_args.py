"""``toptheta-eval``'s model_args, read into the settings of a run spec (``RunSpec.from_model_args``).

``run.py`` gets its settings from Hydra's composed config; ``toptheta-eval`` gets the same settings as lm-eval's
``--model_args`` (``sparsifier=topk,k=32,comp=sdc+vmc,...``). This module turns the second spelling into the first:
the sparsifier, comp and calib dicts ``run.py``'s pipeline plans, checked by the checks ``run.py``'s configuration
meets (``config.sparsifier_problems``, ``builders.check_combination``), before any model loads. The model_args it does
not know are left for lm-eval's HFLM (``batch_size``, ``max_length``, ...).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from .builders import check_combination, resolve_placement
from .config import CalibConfig, CompConfig, defaults, sparsifier_problems
from .registry import compensation_kinds, sparsifier_kind, sparsifier_names

DEFAULT_K = 64  # the budget of Top-k and Top-θ when k is not given
DEFAULT_LAYER_K = "0:512+1:512"  # conf/sparsifier/*.yaml's default: the paper keeps layers 0-1 dense
SAMPLERS = (None, "default", "first_n")  # conf/task's fewshot_sampler
BEYOND = ("clamp", "fit")  # conf/calib's beyond
# conf/calib/paper.yaml's settings, so thresholds calibrated here and by run.py share the cache.
CALIB_DEFAULTS = {key: value for key, value in defaults(CalibConfig).items()
                  if key not in ("beyond", "cover_shots", "max_length")}  # at their defaults: not in the cache key


def parse_layer_k(value: Any) -> dict[int, int]:
    """``0:512+1:512`` (or a dict) -> {0: 512, 1: 512}; ``none`` or empty -> {}."""
    if value in (None, "", "none", "null", {}):
        return {}
    if isinstance(value, dict):
        items = value.items()
    else:
        try:
            items = [part.split(":") for part in str(value).split("+")]
            items = [(int(a), int(b)) for a, b in items]
        except ValueError:
            raise ValueError(f"layer_k={value!r}: write layer:k pairs joined by '+', e.g. layer_k=0:512+1:512, "
                             "or layer_k=none") from None
    return {int(a): int(b) for a, b in items}


def parse_comp(comp: Any, settings: dict) -> dict:
    """``sdc+vmc`` -> the pipeline's comp dict: run.py's defaults (conf/comp/none.yaml: {"sdc": None, "sdc_scale": 1.0,
    "vmc": False}), each named compensation switched on (``comp.<name>``: its model_arg, e.g. ``sdc=calibrated``, else
    the value it takes when on), and the settings it reads (``sdc_scale``) from ``settings`` (model_args)."""
    parts = [] if comp in (None, "", "none") else str(comp).split("+")
    kinds = {kind.name: kind for kind in compensation_kinds()}
    unknown = [p for p in parts if p not in kinds]
    if unknown:
        raise ValueError(f"comp={comp!r}: use none, or compensations joined by '+' from {', '.join(kinds)} (e.g. "
                         "sdc+vmc; the SDC estimator is the separate model_arg sdc=exact|exp-threshold|calibrated)")
    out = {f.name: f.default for f in fields(CompConfig)}
    for name in parts:
        kind = kinds[name]
        out[name] = settings.get(name, kind.on)
        out.update({key: settings[key] for key in kind.keys if key in settings})
    if "sdc_scale" in out:  # a number from the command line may arrive as an int
        out["sdc_scale"] = float(out["sdc_scale"])
    return out


def sparsifier_and_comp(name: str, k: Any, layer_k: Any, placement: str, comp: Any,
                        model_args: dict) -> tuple[dict, dict, dict]:
    """(sparsifier, comp, the model_args left for HFLM): the settings as run.py's pipeline has them, checked, the
    placement resolved. The model_args that name a sparsifier's or compensation's setting (its ``sparsifier.<key>`` or
    ``comp.<key>`` in run.py: ``p``, ``lam``, ``sdc``, ``sdc_scale``, ...) are taken out of the rest."""
    sparse_keys = {key for kind in map(sparsifier_kind, sparsifier_names()) for key in kind.keys}
    comp_keys = {key for kind in compensation_kinds() for key in (kind.name, *kind.keys)}
    settings = {key: model_args[key] for key in sorted((sparse_keys | comp_keys) & set(model_args))}
    rest = {key: value for key, value in model_args.items() if key not in settings}
    if name in sparsifier_names() and sparsifier_kind(name).drops:
        budget = DEFAULT_K if sparsifier_kind(name).parameter is None else None
        sparse = {"name": name, "k": budget if k is None else k, "layer_k": parse_layer_k(layer_k),
                  "placement": placement}
    else:  # dense (or a name the check below refuses): no budget, nothing to compensate
        sparse, comp = {"name": name, "k": None, "layer_k": {}, "placement": placement}, None
    sparse.update({key: value for key, value in settings.items() if key in sparse_keys})
    comp = parse_comp(comp, {key: value for key, value in settings.items() if key in comp_keys})
    problems = sparsifier_problems({**sparse, "target_kept": None}, comp, fits_target=False)
    if problems:  # run.py's messages, in model_args' spelling (p=0.9, not sparsifier.p=0.9)
        text = "; ".join(problems).replace("sparsifier.name=", "sparsifier=")
        raise ValueError(text.replace("sparsifier.", "").replace("comp.", ""))
    sparse["placement"] = resolve_placement(sparse, comp)
    check_combination(name, sparse["placement"], comp)
    return sparse, comp, rest


def calibration(task: str | None, num_samples: int, num_fewshot: int | None, sampler: str | None, cover_shots: int,
                beyond: str, granularity: str, sigma_add: float, max_length: int | None = None) -> dict:
    """run.py's calib dict (conf/calib/paper.yaml with these settings), checked. Options at the value they had before
    they existed are left out, so both entry points share the thresholds cache (thresholds_cache.thresholds_key)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"calib_sampler={sampler!r}: use first_n (the task's exemplars are its first "
                         "num_fewshot documents, task.fewshot_sampler=first_n in run.py) or default")
    if not isinstance(cover_shots, int) or isinstance(cover_shots, bool) or cover_shots < 0:
        raise ValueError(f"calib_cover_shots={cover_shots!r}: give 0 or a positive number of extra shots, "
                         "e.g. calib_cover_shots=4 with calib_fewshot=25")
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool)
                                   or max_length < 2):
        raise ValueError(f"calib_max_length={max_length!r}: give the tokens a calibration sequence is cut to (≥ 2), "
                         "e.g. calib_max_length=16384 to calibrate on long documents uncut")
    if beyond not in BEYOND:
        raise ValueError(f"beyond={beyond!r}: use clamp (θ of the longest calibrated row) or fit (a law of θ "
                         "against row length, extrapolated)")
    calib = {**CALIB_DEFAULTS, "task": task, "num_samples": num_samples, "num_fewshot": num_fewshot,
             "granularity": granularity, "sigma_add": float(sigma_add)}
    for key, value, before in (("fewshot_sampler", sampler, None), ("cover_shots", cover_shots, 0),
                               ("beyond", beyond, "clamp"), ("max_length", max_length, None)):
        if value not in (before, "default"):
            calib[key] = value
    return calib


def resolve_device(device: str | None) -> str:
    """``device`` as given, or cuda where CUDA is available, else cpu; cuda without CUDA is an error, never a silent
    CPU run."""
    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device} but CUDA is not available on this machine (torch "
                         f"{torch.__version__}); pass device=cpu to run on the CPU, or install a CUDA build of "
                         "torch where a GPU is present")
    return device or ("cuda" if torch.cuda.is_available() else "cpu")
