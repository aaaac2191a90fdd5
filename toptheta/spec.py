"""A run, typed: what ``run.py``, ``toptheta-eval``, the sweeps and Python callers hand to the evaluation.

``RunSpec`` holds one section per config group (``ModelSpec``, ``TaskSpec``, ``SparsifierSpec``, ``CompSpec``,
``CalibSpec``, and ``TargetRows`` for matched sparsity), each a frozen dataclass whose fields carry the defaults the
code applies when a setting is absent. Code reads the fields (``spec.calib.sigma_add``), never string keys.

Each section also keeps the settings it was read from (``settings``): that mapping, not the fields, is the run's
identity. ``RunSpec.identity()`` rebuilds the dict the results store hashes into the run id exactly as it was planned
(absent keys stay absent, so adding a field with its default changes no stored id), and the builders that dispatch
on registered kinds (``builders.build_sparsifier``, ``compensation_objects``) receive the settings of sections
whose registered kinds may carry fields of their own.

Build one with ``RunSpec.from_identity`` (the pipeline's ``plan`` does, from a Hydra config; the store's
``config.json`` reads back the same way, and so can a dict from Python), ``RunSpec.from_model_args``
(``toptheta-eval``'s model_args, read by model_args.py with run.py's checks) or ``RunSpec.for_thresholds`` (a
calibration alone).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from .builders import build_sparsifier, compensation_objects, needs_thresholds
from .model_args import DEFAULT_LAYER_K, calibration, resolve_device, sparsifier_and_comp


class Section:
    """A config group's section: typed fields with the code's defaults, and the settings they were read from."""

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any] | None):
        """The fields present in ``settings``, the defaults for the rest; every setting kept in ``settings``."""
        settings = dict(settings or {})
        names = {f.name for f in dataclasses.fields(cls)} - {"settings"}
        return cls(**{key: settings[key] for key in names if key in settings}, settings=settings)


def data_source(data_dir_path: str | None) -> str:
    """Where a run's data came from, as its run id records it: "local" (a data dir) or "hub"."""
    return "local" if data_dir_path else "hub"


def data_dir_setting(source: str) -> str:
    """The data_dir setting that reads a recorded `source` again on this machine: "auto" (the local copy) or "hub"."""
    return "auto" if source == "local" else "hub"


@dataclass(frozen=True)
class ModelSpec(Section):
    name: str = ""
    source: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    device_map: str | None = None
    revision: str | None = None
    max_length: int | None = None  # tokens of context; None: the model's own limit
    chat_template: bool = False
    settings: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class TaskSpec(Section):
    """An evaluated task. Generation tasks read their own settings (``settings``: lengths, depths, ruler, ...)."""

    kind: str = "lm_eval"
    name: str = ""
    lm_eval_task: str | None = None
    include_path: str | None = None
    calib_task: str | None = None
    num_fewshot: int | None = None
    fewshot_sampler: str | None = None
    limit: Any = None
    batch_size: Any = 1
    max_length: int | None = None
    decode_batch: int | None = None
    vrow_popularity: dict | None = None
    prefix_cache: bool = True  # how scoring runs, not what it scores: outside the run id
    settings: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class SparsifierSpec(Section):
    """The sparsifier's settings; ``settings`` goes to its registered kind's builder (fields of its own included)."""

    name: str = "dense"
    placement: str | None = None
    k: int | None = None
    layer_k: dict = field(default_factory=dict)
    target_kept: float | None = None
    target_measure: str | None = None
    target_task: str | None = None
    target_tolerance: float | None = None
    settings: dict = field(default_factory=dict, repr=False, compare=False)

    def build(self, thresholds=None):
        return build_sparsifier(self.settings, thresholds)


@dataclass(frozen=True)
class CompSpec(Section):
    """The compensations switched on; registered compensations may add settings of their own (``settings``)."""

    sdc: str | None = None
    sdc_scale: float = 1.0
    vmc: bool = False
    settings: dict = field(default_factory=dict, repr=False, compare=False)

    def objects(self, thresholds=None) -> list:
        return compensation_objects(self.settings, thresholds)


@dataclass(frozen=True)
class CalibSpec(Section):
    """How thresholds are calibrated (and read at run time: lookup, smooth_sigma, beyond)."""

    task: str | None = None
    num_fewshot: int | None = None
    num_samples: int | None = None
    seed: int = 0
    fewshot_sampler: str | None = None
    cover_shots: int = 0
    statistic: str = "order"
    granularity: str = "layer-head-n"
    sigma_add: float = 0.1
    tac: bool = True
    sample_frac: float = 1.0
    compensation: str = "run"
    decode_tokens: int = 0
    lookup: str = "nearest"
    smooth_sigma: float = 0.0
    beyond: str = "clamp"
    max_length: int | None = None
    settings: dict = field(default_factory=dict, repr=False, compare=False)

    def key_settings(self) -> dict:
        """The settings that change what is calibrated (the thresholds cache key): run-time lookup options and what
        calibration puts back (keyed separately, as the compensations it applies) left out."""
        return {k: v for k, v in self.settings.items() if k not in ("lookup", "smooth_sigma", "compensation", "beyond")}


@dataclass(frozen=True)
class TargetRows(Section):
    """Matched sparsity: the calibration rows ``sparsifier.target_kept`` is resolved on; with ``kind`` (a generation
    task that builds its own, registry.TaskKindEntry.target_prompts) prompts shaped as the evaluated task's, none of
    them evaluated (ruler: another draw; HumanEval: python_code functions)."""

    task: str | None = None
    kind: str | None = None
    num_fewshot: int | None = None
    num_samples: int | None = None
    seed: int = 0
    fewshot_sampler: str | None = None
    settings: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class RunSpec:
    """One evaluation: typed sections, and the identity the results store keys on (``identity()``)."""

    model: ModelSpec
    task: TaskSpec
    sparsifier: SparsifierSpec
    comp: CompSpec
    calib: CalibSpec | None = None  # None when the run needs no thresholds
    target: TargetRows | None = None  # None unless sparsifier.target_kept is set
    data_dir: str = "local"  # local | hub: where the data came from (in the run id)
    data_dir_path: str | None = None  # where it lives here (not in the run id: the same data can live anywhere)
    seed: int | None = None
    run_id: str = ""
    label: str = ""
    notes: list = field(default_factory=list)
    log_samples: bool = False  # keep lm-eval's per-sample outputs (not part of the run id)

    @classmethod
    def from_identity(cls, identity: Mapping[str, Any], **rest) -> RunSpec:
        """A spec from the dict a run id is computed from (``identity()``, or a stored run's config.json)."""
        identity = copy.deepcopy(dict(identity))
        task = dict(identity.get("task") or {})
        return cls(model=ModelSpec.from_settings(identity.get("model")), task=TaskSpec.from_settings(task),
                   sparsifier=SparsifierSpec.from_settings(identity.get("sparsifier")), comp=CompSpec.from_settings(identity.get("comp")),
                   calib=None if identity.get("calib") is None else CalibSpec.from_settings(identity["calib"]),
                   target=None if identity.get("target") is None else TargetRows.from_settings(identity["target"]),
                   data_dir=identity.get("data_dir", "local"), seed=identity.get("seed"), **rest)

    @classmethod
    def for_thresholds(cls, *, model: Mapping[str, Any], sparsifier: Mapping[str, Any], comp: Mapping[str, Any],
                       calib: Mapping[str, Any], data_dir_path: str | None) -> RunSpec:
        """A spec that only calibrates (no task): what ``thresholds_cache.obtain_thresholds`` needs."""
        return cls.from_identity({"model": model, "sparsifier": sparsifier, "comp": comp, "calib": calib,
                                  "data_dir": data_source(data_dir_path)}, data_dir_path=data_dir_path)

    @classmethod
    def from_model_args(cls, pretrained: str, *, sparsifier: str = "toptheta", k: int | None = None,
                        layer_k: Any = DEFAULT_LAYER_K, placement: str = "auto", comp: str | None = "vmc",
                        calib_task: str | None = None, calib_samples: int = 120, calib_fewshot: int | None = None,
                        calib_sampler: str | None = None, calib_cover_shots: int = 0,
                        calib_max_length: int | None = None, beyond: str = "clamp",
                        granularity: str = "layer-head-n", sigma_add: float = 0.1, dtype: str = "float32",
                        device: str | None = None, device_map: str | None = None, revision: str | None = None,
                        data_dir_path: str | None = None, **rest) -> tuple[RunSpec, dict]:
        """A spec from ``toptheta-eval``'s model_args (spelled as lm_eval_model.py documents them), checked as
        ``run.py`` checks its config, and the model_args left for lm-eval's HFLM. No task: lm-eval chooses it."""
        sparse, comp_settings, rest = sparsifier_and_comp(sparsifier, k, layer_k, placement, comp, rest)
        calib = calibration(calib_task, calib_samples, calib_fewshot, calib_sampler, calib_cover_shots, beyond,
                            granularity, sigma_add, max_length=calib_max_length)
        model = {"name": pretrained, "dtype": dtype, "device": resolve_device(device), "device_map": device_map,
                 "revision": revision}
        spec = cls.from_identity({"model": model, "sparsifier": sparse, "comp": comp_settings,
                                  "calib": calib if needs_thresholds(sparse, comp_settings) else None,
                                  "data_dir": data_source(data_dir_path)}, data_dir_path=data_dir_path)
        return spec, rest

    def identity(self) -> dict:
        """The dict the run id is the hash of: every section's settings as planned (prefix_cache left out)."""
        ident = {"model": dict(self.model.settings),
                 "task": {k: v for k, v in self.task.settings.items() if k != "prefix_cache"},
                 "data_dir": self.data_dir, "seed": self.seed}
        if self.target is not None:
            ident["target"] = dict(self.target.settings)
        ident.update(sparsifier=dict(self.sparsifier.settings), comp=dict(self.comp.settings),
                     calib=None if self.calib is None else dict(self.calib.settings))
        return copy.deepcopy(ident)

    def stored_config(self) -> dict:
        """What a finished run's config.json holds: the identity, and the task's prefix_cache beside it."""
        config = self.identity()
        config["task"]["prefix_cache"] = self.task.prefix_cache
        return config

    def with_sparsifier(self, **changes) -> RunSpec:
        """A copy whose sparsifier settings are changed (matched sparsity resolves k, p or λ this way)."""
        settings = {**self.sparsifier.settings, **changes}
        return dataclasses.replace(self, sparsifier=SparsifierSpec.from_settings(settings), notes=list(self.notes))

    def with_task(self, **changes) -> RunSpec:
        return dataclasses.replace(self, task=TaskSpec.from_settings({**self.task.settings, **changes}), notes=list(self.notes))
