"""The lm-eval model ``toptheta``: lm-eval's HFLM with Top-θ (or any registered sparsifier's) attention and compensation.

From the shell (``toptheta-eval`` is lm-eval's own command line with this model registered; it takes
every ``lm_eval`` flag)::

    toptheta-eval --model toptheta --tasks arc_challenge \\
        --model_args pretrained=smollm2-135m,sparsifier=toptheta,k=64,placement=post,comp=vmc,thresholds=t.safetensors

From Python, after ``import toptheta`` (which puts the name in lm-eval's model registry)::

    lm_eval.simple_evaluate(model="toptheta", model_args="pretrained=tiny-llama,k=16", tasks=[...])

``model_args``, besides HFLM's own (``batch_size``, ``max_length``, ...):

==================  =============================================================================================
``pretrained``      a packaged name (``smollm2-135m``), ``tiny-<arch>``, a local directory or a hub id (load_model)
``sparsifier``      a registered sparsifier (toptheta/registry.py): ``toptheta`` (default), ``topk``, ``dense``,
                    ``topp`` (with ``p``, e.g. ``p=0.9``), ``skipsoftmax`` (with ``lam``, e.g. ``lam=1.0``)
``k``, ``layer_k``  k and per-layer exceptions as ``0:512+1:512`` (the default) or ``none``; k is the budget of
                    Top-k and Top-θ (default 64); for top-p and skip-softmax rows with at most k keys are kept whole
                    (default: none)
``placement``       ``auto`` (pre-softmax with SDC, else post), ``pre``, ``post``
``comp``            ``none``, or registered compensations joined by ``+``: ``sdc``, ``vmc`` (default), ``sdc+vmc``;
                    ``sdc`` = ``exact`` (default) | ``exp-threshold`` | ``calibrated`` picks the SDC estimator,
                    ``sdc_scale`` scales it (a compensation's settings are its ``comp.`` keys in run.py)
``thresholds``      a thresholds file (``Thresholds.save``), refused when calibrated for another k, layer_k or
                    placement. Without one, a ``pretrained`` folder's own (``Thresholds.save_pretrained``) with these
                    settings is used; else Top-θ calibrates before the first request and caches the result (as
                    ``run.py`` does; parallel jobs calibrate once)
``calib_task``      the calibration task (its train split); default: the evaluated task when our catalogue has
                    its train split, else ``arc_challenge``. Also ``calib_samples`` (120), ``calib_fewshot``,
                    ``calib_sampler`` (``first_n`` when the task's exemplars are fixed, as run.py's
                    ``task.fewshot_sampler``), ``calib_cover_shots`` (0; N also calibrates at calib_fewshot + N
                    shots, so rows reach past the longest question), ``granularity`` (``layer-head-n``),
                    ``sigma_add`` (0.1)
``beyond``          rows longer than any calibrated one: ``clamp`` (default, the longest row's θ) or ``fit``
``data_dir``        ``auto`` (shipped data / $TOPTHETA_DATA_DIR), ``hub`` or a folder: calibration data, and the
                    data of the offline tasks ``toptheta-eval`` runs
``dtype``, ``device``, ``device_map``, ``revision``, ``chunk_size``: loading and attention chunking (``device=cuda``
                    without CUDA is an error, never a silent CPU run; ``device_map=auto`` spreads a 70B model)
``decode_batch``    generation (generate_until) requests decoded together; default ``batch_size``
==================  =============================================================================================

Every request runs inside ``toptheta.sparsify``, one block per task, so each task gets its own sparsity
statistics. They land in lm-eval's results JSON under ``config.toptheta``: the settings, the thresholds
file, and per task ``kept_attention_fraction``, ``kept_vrow_fraction``, ... (and per layer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
from lm_eval.api.registry import register_model

from .. import builders, pipeline, sparsify, thresholds_cache
from ..attention.backend import check_supported
from ..calibration import Thresholds
from ..thresholds.checkpoint import check_settings, matching
from ..config import CalibConfig, CompConfig, defaults, sparsifier_problems
from ..guards import warn_unintended
from ..registry import compensation_kinds, sparsifier_kind, sparsifier_names
from ..spec import RunSpec
from .shared_context_lm import SharedContextHFLM, check_decode_batch
from .tasks import calibration_name, check_tasks, resolve_data_dir

log = logging.getLogger(__name__)

DEFAULT_K = 64  # the budget of Top-k and Top-θ when k is not given
SAMPLERS = (None, "default", "first_n")  # conf/task's fewshot_sampler
BEYOND = ("clamp", "fit")  # conf/calib's beyond
DEFAULT_LAYER_K = "0:512+1:512"  # conf/sparsifier/*.yaml's default: the paper keeps layers 0-1 dense
# conf/calib/paper.yaml's settings, so thresholds calibrated here and by run.py share the cache.
CALIB_DEFAULTS = {key: value for key, value in defaults(CalibConfig).items()
                  if key not in ("beyond", "cover_shots")}  # options at their defaults stay out of the cache key


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
        raise ValueError(f"comp={comp!r}: use none, or compensations joined by '+' from {', '.join(kinds)} "
                         f"(e.g. sdc+vmc; the SDC estimator is the separate model_arg sdc=exact|exp-threshold|calibrated)")
    out = {f.name: f.default for f in fields(CompConfig)}
    for name in parts:
        kind = kinds[name]
        out[name] = settings.get(name, kind.on)
        out.update({key: settings[key] for key in kind.keys if key in settings})
    if "sdc_scale" in out:  # a number from the command line may arrive as an int
        out["sdc_scale"] = float(out["sdc_scale"])
    return out


@register_model("toptheta")
class TopThetaLM(SharedContextHFLM):
    """lm-eval's HFLM over a model from ``toptheta.models.load_model``, every request inside ``toptheta.sparsify``.

    Multiple-choice requests are scored as ``run.py`` scores them (SharedContextHFLM: each context once, padded
    batches with a mask), so ``--batch_size`` > 1 never counts padded rows in the sparsity statistics."""

    def __init__(self, pretrained: str, sparsifier: str = "toptheta", k: int | None = None, layer_k: Any = DEFAULT_LAYER_K,
                 placement: str = "auto", comp: str | None = "vmc",
                 thresholds: str | None = None, calib_task: str | None = None, calib_samples: int = 120,
                 calib_fewshot: int | None = None, calib_sampler: str | None = None, calib_cover_shots: int = 0,
                 beyond: str = "clamp", granularity: str = "layer-head-n", sigma_add: float = 0.1,
                 data_dir: str | None = "auto", dtype: str = "float32", device: str | None = None,
                 device_map: str | None = None, revision: str | None = None, chunk_size: int | None = None,
                 **hflm_kwargs):
        from ..models import load_model  # heavy: transformers' model classes (torch._dynamo, triton)

        # Every setting is checked before the model loads, by the checks run.py's configuration meets
        # (config.sparsifier_problems); the settings of sparsifiers and compensations are model_args named as their
        # sparsifier.<key> and comp.<key> (p, lam, sdc, sdc_scale, ...), taken out of HFLM's.
        self.sparse_cfg, self.comp = self._settings(sparsifier, k, layer_k, placement, comp, hflm_kwargs)
        check_decode_batch(hflm_kwargs.get("decode_batch"))
        self.sparse_cfg["placement"] = pipeline.resolve_placement(self.sparse_cfg, self.comp)
        builders.check_combination(sparsifier, self.sparse_cfg["placement"], self.comp)
        if calib_sampler not in SAMPLERS:
            raise ValueError(f"calib_sampler={calib_sampler!r}: use first_n (the task's exemplars are its first "
                             "num_fewshot documents, task.fewshot_sampler=first_n in run.py) or default")
        if not isinstance(calib_cover_shots, int) or isinstance(calib_cover_shots, bool) or calib_cover_shots < 0:
            raise ValueError(f"calib_cover_shots={calib_cover_shots!r}: give 0 or a positive number of extra shots, "
                             "e.g. calib_cover_shots=4 with calib_fewshot=25")
        if beyond not in BEYOND:
            raise ValueError(f"beyond={beyond!r}: use clamp (θ of the longest calibrated row) or fit (a law of θ "
                             "against row length, extrapolated)")
        self.data_dir = resolve_data_dir(data_dir)
        self.calib = {**CALIB_DEFAULTS, "task": calib_task, "num_samples": calib_samples,
                      "num_fewshot": calib_fewshot, "granularity": granularity, "sigma_add": float(sigma_add)}
        # run.py's calib dict: options at the value they had before they existed are left out, so both share
        # the thresholds cache (pipeline.plan)
        for key, value, before in (("fewshot_sampler", calib_sampler, None), ("cover_shots", calib_cover_shots, 0),
                                   ("beyond", beyond, "clamp")):
            if value not in (before, "default"):
                self.calib[key] = value
        self.needs_thresholds = builders.needs_thresholds(self.sparse_cfg, self.comp)
        self.chunk_size = chunk_size
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device} but CUDA is not available on this machine (torch "
                             f"{torch.__version__}); pass device=cpu to run on the CPU, or install a CUDA build of "
                             "torch where a GPU is present")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")

        model, tokenizer, info = load_model(pretrained, dtype=dtype, device=device, device_map=device_map,
                                            revision=revision)
        self.info = info
        super().__init__(pretrained=model, tokenizer=tokenizer, **hflm_kwargs)
        check_supported(model)  # sinks, or attention that bypasses the interface: refused before any request
        builders.check_sparsifies(self.sparse_cfg, info.num_layers, self.max_length, info.name)
        self.thresholds, self.thresholds_path = None, None
        if thresholds is not None:
            self.thresholds = Thresholds.load(thresholds, model, lookup=self.calib["lookup"], beyond=beyond)
            self.thresholds_path = str(thresholds)
            self._check_file_settings(f"thresholds={thresholds}", info.num_layers)
        elif self.needs_thresholds:  # a model folder that carries its own (Thresholds.save_pretrained)
            wanted = {"k_per_layer": self._k_per_layer(info.num_layers), "placement": self.sparse_cfg["placement"],
                      "granularity": granularity, "sigma_add": float(sigma_add), "calibration_documents": calib_samples,
                      "cover_shots": calib_cover_shots, "fewshot_sampler": self.calib.get("fewshot_sampler"),
                      **({"calibration_task": calib_task} if calib_task else {})}
            found = (matching(pretrained, wanted, model, lookup=self.calib["lookup"], beyond=beyond)
                     if isinstance(pretrained, str) else None)
            if found is not None:
                self.thresholds, self.thresholds_path = found
        self.task_stats: dict[str, Any] = {}
        self._warned: set[str] = set()  # tasks whose unintended-run warnings were given (guards.warn_unintended)

    @staticmethod
    def _settings(name: str, k, layer_k, placement: str, comp, model_args: dict) -> tuple[dict, dict]:
        """(sparsifier, comp) settings as run.py's pipeline has them, checked; the model_args that name a
        sparsifier's or compensation's setting are removed from ``model_args`` (HFLM's own remain)."""
        sparse_keys = {key for kind in map(sparsifier_kind, sparsifier_names()) for key in kind.keys}
        comp_keys = {key for kind in compensation_kinds() for key in (kind.name, *kind.keys)}
        settings = {key: model_args.pop(key) for key in sorted((sparse_keys | comp_keys) & set(model_args))}
        drops = name in sparsifier_names() and sparsifier_kind(name).drops
        if drops:
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
        return sparse, comp

    def _k_per_layer(self, num_layers: int) -> list[int]:
        return [self.sparse_cfg["layer_k"].get(layer, self.sparse_cfg["k"]) for layer in range(num_layers)]

    def _check_file_settings(self, source: str, num_layers: int) -> None:
        """A thresholds file calibrated for another k, layer_k or placement is refused: Top-θ would keep the file's
        k while the report names the requested one."""
        if not self.needs_thresholds:
            return
        meta = self.thresholds.metadata
        layer_k = "+".join(f"{a}:{b}" for a, b in (meta.get("layer_k") or {}).items()) or "none"
        fix = (f"pass the file's settings (k={meta.get('k')},layer_k={layer_k},placement={self.thresholds.placement}), "
               "or drop thresholds= to calibrate for these")
        check_settings(self.thresholds, self._k_per_layer(num_layers), self.sparse_cfg["placement"], source, fix)

    # ---- requests: each task's requests inside one sparsify block ----------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._sparsified(super().loglikelihood, requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._sparsified(super().loglikelihood_rolling, requests, disable_tqdm)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._sparsified(super().generate_until, requests, disable_tqdm)

    def _sparsified(self, method: Callable, requests: list, disable_tqdm: bool) -> list:
        by_task: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            by_task.setdefault(request.task_name or "unnamed", []).append(i)
        sparsifier, compensation = self._build(list(by_task))
        out: list = [None] * len(requests)
        for task, indices in by_task.items():
            with torch.no_grad(), sparsify(self._model, sparsifier, compensation, chunk_size=self.chunk_size) as stats:
                answers = method([requests[i] for i in indices], disable_tqdm=disable_tqdm)
            self._accumulate(task, stats)
            for i, answer in zip(indices, answers):
                out[i] = answer
        return out

    def _build(self, tasks: list[str]):
        if self.needs_thresholds and self.thresholds is None:
            self.thresholds, self.thresholds_path = self._calibrate(tasks)
        sparsifier = builders.build_sparsifier(self.sparse_cfg, self.thresholds)
        return sparsifier, builders.compensation_objects(self.comp, self.thresholds)

    def _calibrate(self, tasks: list[str]):
        """Cached thresholds for these settings, calibrated now if no job has yet (thresholds_cache.obtain_thresholds)."""
        calib = self.calib = {**self.calib, "task": self.calib["task"] or self._calibration_task(tasks)}
        model_cfg = {"name": self.info.name, "source": self.info.source, "revision": self.info.revision,
                     "dtype": str(self._model.dtype).removeprefix("torch."), "max_length": self.max_length}
        spec = RunSpec.for_thresholds(model=model_cfg, sparsifier=self.sparse_cfg, comp=self.comp, calib=calib,
                                      data_dir_path=str(self.data_dir) if self.data_dir else None)
        log.info("toptheta: thresholds for k=%s, placement=%s from %s's train split", self.sparse_cfg["k"],
                 self.sparse_cfg["placement"], calib["task"])
        with torch.no_grad(), thresholds_cache.thresholds_claim(spec, self._model):
            return thresholds_cache.obtain_thresholds(spec, self._model, self.tokenizer)

    def _calibration_task(self, tasks: list[str]) -> str:
        """The evaluated task when it is the only one and its train split is available, else arc_challenge."""
        if len(tasks) == 1:
            try:
                check_tasks([calibration_name(tasks[0])], self.data_dir, None)
                return tasks[0]
            except (ValueError, FileNotFoundError) as err:
                log.info("toptheta: cannot calibrate on %s (%s); using arc_challenge", tasks[0], err)
        return "arc_challenge"

    def _accumulate(self, task: str, stats) -> None:
        total = self.task_stats.get(task)
        if total is None:
            self.task_stats[task] = stats
            return
        total.add(stats)  # every counter, the clamped rows and the calls per backend

    # ---- what lands in lm-eval's results JSON ------------------------------------------------------------------

    def toptheta_report(self) -> dict:
        """Settings, thresholds file and per-task sparsity statistics (results["config"]["toptheta"])."""
        return {
            "model": {"name": self.info.name, "source": self.info.source, "revision": self.info.revision},
            "sparsifier": self.sparse_cfg,
            "comp": self.comp,
            "calibration": ({**self.calib, "thresholds": self.thresholds_path}
                            if self.needs_thresholds else None),
            "stats": {task: {**s.summary(), "per_layer": s.per_layer()} for task, s in self.task_stats.items()},
        }

    def warn_unintended(self) -> None:
        """run.py's warnings (guards.py), once per task: a sparse task that kept nearly every attention element,
        and rows longer than any calibrated row."""
        for task, stats in self.task_stats.items():
            if task not in self._warned:
                self._warned.add(task)
                warn_unintended(f"toptheta-eval {task}", self.sparse_cfg, self.calib if self.needs_thresholds else None,
                                stats, self.thresholds)

    def get_model_info(self) -> dict:
        """lm-eval asks for this once, after the evaluation: the report, and the warnings its statistics call for."""
        self.warn_unintended()
        return {**super().get_model_info(), "toptheta": self.toptheta_report()}
