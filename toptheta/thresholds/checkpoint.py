"""Thresholds beside the checkpoint: a Hugging Face model folder that carries its own calibrated θ.

Thresholds are a property of the model (the paper stores all of LLaMA-3-70B's in 11.8 MB), so a calibrated
checkpoint can be shared as one folder::

    model.save_pretrained("my-model"); tokenizer.save_pretrained("my-model")
    thresholds.save_pretrained("my-model")            # my-model/toptheta.json + toptheta-<key>.safetensors
    thresholds = Thresholds.from_pretrained("my-model", model=model)

``toptheta.json`` is a small index: the model the thresholds were calibrated on (identity and shape, checked on
both save and load) and one entry per saved set, with the settings that determine it (k per layer, placement and
the calibration settings) and its safetensors file (written by ``Thresholds.save``: atomic and fsynced). Saving
a set with the settings of an existing entry replaces it. ``run.py model.source=<folder>`` and ``toptheta-eval
--model_args pretrained=<folder>`` use a set whose settings match the run's (``matching``) instead of calibrating.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import write_text_atomic
from ..cachedir import identity_key
from .table import Thresholds, model_fingerprint, model_identity

if TYPE_CHECKING:
    from ..spec import CalibSpec, SparsifierSpec

log = logging.getLogger("toptheta")

INDEX = "toptheta.json"
FORMAT_VERSION = 1
# Metadata keys (toptheta.calibrate's provenance and the pipeline's) that determine a set of thresholds.
SETTINGS = ("k_per_layer", "placement", "statistic", "granularity", "sigma_add", "tac", "calibration_compensation",
            "calibration_task", "calibration_documents", "num_fewshot", "sample_frac", "seed", "generate_tokens",
            "cover_shots", "fewshot_sampler", "budget")
# What a set saved before a setting existed was calibrated with: its metadata does not record it, and runs at this
# value must still find it (and runs at any other value must not).
ABSENT = {"cover_shots": 0, "fewshot_sampler": None, "budget": None}


def settings_of(thresholds: Thresholds) -> dict:
    """The settings a set of thresholds was calibrated with, as far as its metadata records them."""
    meta = thresholds.metadata
    found = {key: meta[key] for key in SETTINGS if key in meta}
    return {**found, "k_per_layer": list(thresholds.k), "placement": thresholds.placement}


def run_settings(sparsifier: SparsifierSpec, calib: CalibSpec, calibration_compensation: list[str],
                 num_layers: int) -> dict:
    """The settings a run asks its thresholds for (``settings_of``'s keys), from its spec's sections."""
    layer_k = {int(a): int(b) for a, b in (sparsifier.layer_k or {}).items()}
    return {"k_per_layer": [layer_k.get(layer, sparsifier.k) for layer in range(num_layers)],
            "placement": sparsifier.placement, "statistic": calib.statistic, "granularity": calib.granularity,
            "sigma_add": float(calib.sigma_add) if calib.statistic == "order" else None,
            "tac": bool(calib.tac), "calibration_compensation": list(calibration_compensation),
            "calibration_task": calib.task, "calibration_documents": calib.num_samples,
            "num_fewshot": calib.num_fewshot, "sample_frac": float(calib.sample_frac), "seed": int(calib.seed),
            "generate_tokens": int(calib.decode_tokens or 0), "cover_shots": int(calib.cover_shots or 0),
            "fewshot_sampler": calib.fewshot_sampler, **budget_record(sparsifier.settings)}


def calibration_budget(sparsifier: dict) -> dict:
    """``toptheta.calibrate``'s rho and head_weights for a Top-θ run calibrated to Top-ρ (``sparsifier.budget=toprho``),
    {} for the paper's top-k budget."""
    if sparsifier.get("budget") != "toprho":
        return {}
    weights = sparsifier.get("head_weights")
    return {"rho": float(sparsifier["rho"]),
            "head_weights": None if weights is None else [[float(w) for w in row] for row in weights]}


def budget_record(sparsifier: dict) -> dict:
    """``{"budget": ...}`` as ``toptheta.calibrate`` records it for a run's settings (None for top-k)."""
    budget = calibration_budget(sparsifier)
    return {"budget": {"rule": "toprho", **budget} if budget else None}


def differences(have: dict, want: dict) -> dict:
    """{key: (have, want)} for the keys of ``want`` that ``have`` records differently (missing counts as the value
    of a set saved before the key existed, ``ABSENT``, else None)."""
    def same(a, b) -> bool:
        if isinstance(a, float) or isinstance(b, float):
            return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-12
        return a == b

    return {key: (have.get(key, ABSENT.get(key)), value) for key, value in want.items()
            if not same(have.get(key, ABSENT.get(key)), value)}


def save_pretrained(thresholds: Thresholds, directory: str | os.PathLike) -> Path:
    """Write ``thresholds`` into the model folder ``directory`` (it must hold the model's config.json).

    Refuses a folder whose model has another shape than the one the thresholds were calibrated on. Returns the
    safetensors file written."""
    directory = Path(directory).expanduser()
    config = _folder_config(directory)
    expected, actual = thresholds.metadata.get("fingerprint"), model_fingerprint(config)
    if (expected is not None and {k: expected.get(k) for k in actual} != actual) or thresholds.num_layers != actual["layers"]:
        raise ValueError(f"{directory} holds a model with {actual}, but these thresholds were calibrated for "
                         f"{expected or thresholds.num_layers} layers ({thresholds.metadata.get('model')}); save "
                         "them into the folder of the model they were calibrated on")
    settings = settings_of(thresholds)
    key = identity_key(settings)
    index = _read_index(directory) or {"format": FORMAT_VERSION, "thresholds": []}
    index["model"] = {"identity": thresholds.metadata.get("identity") or {}, "folder": directory.resolve().name,
                      "fingerprint": actual}
    entry = {"file": f"toptheta-{key}.safetensors", "settings": settings, "bytes": thresholds.nbytes()}
    path = thresholds.save(directory / entry["file"])
    index["thresholds"] = [e for e in index["thresholds"] if e["settings"] != settings] + [entry]
    write_text_atomic(directory / INDEX, json.dumps(index, indent=2, sort_keys=True, default=str) + "\n", fsync=True)
    return path


def from_pretrained(directory: str | os.PathLike, model=None, *, settings: dict | None = None,
                    **overrides) -> Thresholds:
    """The thresholds a model folder carries: the set whose settings match ``settings`` (any subset of
    ``SETTINGS``), or its only set. With ``model``, refuse another model (name, revision or shape), as
    ``Thresholds.load`` does. ``overrides``: ``lookup``, ``smooth_sigma``."""
    directory = Path(directory).expanduser()
    index = _read_index(directory)
    if index is None:
        raise FileNotFoundError(f"{directory} carries no thresholds ({INDEX} missing); calibrate and write them "
                                "with thresholds.save_pretrained(folder)")
    entries = [e for e in index["thresholds"] if settings is None or not differences(e["settings"], settings)]
    if len(entries) != 1:
        listed = "; ".join(f"{e['file']}: {e['settings']}" for e in index["thresholds"]) or "none"
        raise ValueError(f"{directory} carries {len(entries)} threshold sets matching {settings or 'any settings'} "
                         f"(of: {listed}); pass settings={{...}} naming the one you want")
    return _load_entry(directory, index, entries[0], model, overrides)


def matching(directory: str | os.PathLike, settings: dict, model, **overrides) -> tuple[Thresholds, str] | None:
    """(thresholds, file) of the set in the model folder ``directory`` whose settings match ``settings``, or None
    when the folder carries no thresholds or none for these settings (said in one line, with what differs)."""
    directory = Path(directory).expanduser()
    index = _read_index(directory) if directory.is_dir() else None
    if index is None:
        return None
    for entry in index["thresholds"]:
        if not differences(entry["settings"], settings):
            thresholds = _load_entry(directory, index, entry, model, overrides)
            log.info("thresholds: from the model folder, %s (saved with this run's settings)", directory / entry["file"])
            return thresholds, str(directory / entry["file"])
    closest = min(index["thresholds"], key=lambda e: len(differences(e["settings"], settings)), default=None)
    if closest is not None:
        log.info("thresholds: %s carries %d set(s), none with this run's settings (closest differs in %s); "
                 "calibrating", directory, len(index["thresholds"]),
                 {k: f"{a} (saved) vs {b}" for k, (a, b) in differences(closest["settings"], settings).items()})
    return None


def check_settings(thresholds: Thresholds, k_per_layer: list[int], placement: str, source: str, fix: str) -> None:
    """Refuse thresholds calibrated for another k schedule or placement than the one asked for, naming both and
    ``fix`` (how to ask for the file's): Top-θ would otherwise keep the file's k and report the requested one."""
    wrong = differences(settings_of(thresholds), {"k_per_layer": list(k_per_layer), "placement": placement})
    if wrong:
        meta = thresholds.metadata
        raise ValueError(f"{source} was calibrated with k per layer {thresholds.k} (k={meta.get('k')}, "
                         f"layer_k={meta.get('layer_k')}) and placement={thresholds.placement!r}, but this run asks "
                         f"k per layer {list(k_per_layer)} and placement={placement!r}; {fix}")


def _load_entry(directory: Path, index: dict, entry: dict, model, overrides: dict) -> Thresholds:
    thresholds = Thresholds.load(directory / entry["file"], allow_other_model=True, **overrides)
    if model is not None:
        _check_identity(directory, index, model)
        thresholds.check_model(model)  # the shape (and the dtype, said once)
        # Verified against the folder: from here on the thresholds are this model's, for sparsify's own check.
        thresholds.metadata["identity"] = model_identity(model)
    # Without a model, sparsify checks the identity they were calibrated on (pass model= to check the folder's).
    thresholds.allow_other_model = False
    return thresholds


def _check_identity(directory: Path, index: dict, model) -> None:
    """The model must be the folder's: named as the folder or as the model the thresholds were calibrated on, with
    the same revision where both are known."""
    recorded = index.get("model") or {}
    identity, actual = recorded.get("identity") or {}, model_identity(model)
    names = {n for n in (identity.get("name"), recorded.get("folder"), directory.resolve().name) if n}
    wrong_name = actual["name"] and actual["name"] not in names
    wrong_revision = identity.get("revision") and actual["revision"] and identity["revision"] != actual["revision"]
    if wrong_name or wrong_revision:
        raise ValueError(f"{directory}'s thresholds are for {sorted(names)} (revision {identity.get('revision')}), "
                         f"but this model is {actual['name']} (revision {actual['revision']}); load the model from "
                         f"{directory}, or calibrate for this model")


def _folder_config(directory: Path):
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face model folder (no config.json); write the model "
                                "there first: model.save_pretrained(folder)")
    from transformers import AutoConfig  # transformers' auto classes: half a second, only for a folder's config

    return AutoConfig.from_pretrained(str(directory))


def _read_index(directory: Path) -> dict | None:
    path = directory / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not readable JSON ({err}); delete it and save the thresholds again") from err
    if not isinstance(index, dict) or index.get("format") != FORMAT_VERSION or not isinstance(index.get("thresholds"), list):
        raise ValueError(f"{path} is not a toptheta index of format {FORMAT_VERSION}; delete it and save the "
                         "thresholds again")
    return index
