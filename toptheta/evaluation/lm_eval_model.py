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
                    ``topp`` (with ``p``, e.g. ``p=0.9``), ``skipsoftmax`` (with ``lam``, e.g. ``lam=1.0``),
                    ``toprho`` (with ``rho``, e.g. ``rho=0.1``)
``k``, ``layer_k``  k and per-layer exceptions as ``0:512+1:512`` (the default) or ``none``; k is the budget of
                    Top-k and Top-θ (default 64); for top-p, skip-softmax and Top-ρ rows with at most k keys are kept
                    whole (default: none)
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
                    shots, so rows reach past the longest question), ``calib_max_length`` (tokens a calibration
                    sequence is cut to; default the model's context as lm-eval cuts requests: raise it to calibrate
                    on long documents), ``granularity`` (``layer-head-n``), ``sigma_add`` (0.1)
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

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from lm_eval.api.registry import register_model

from .. import builders, sparsify, thresholds_cache
from ..attention.backend import check_supported
from ..guards import warn_unintended
from ..spec import CalibSpec, RunSpec
from ..thresholds import Thresholds
from ..thresholds.checkpoint import check_settings, matching
from .shared_context_lm import SharedContextHFLM, check_decode_batch
from .tasks import calibration_name, check_tasks, resolve_data_dir

log = logging.getLogger(__name__)


@register_model("toptheta")
class TopThetaLM(SharedContextHFLM):
    """lm-eval's HFLM over a model from ``toptheta.models.load_model``, every request inside ``toptheta.sparsify``.

    Multiple-choice requests are scored as ``run.py`` scores them (SharedContextHFLM: each context once, padded
    batches with a mask), so ``--batch_size`` > 1 never counts padded rows in the sparsity statistics."""

    def __init__(self, pretrained: str, thresholds: str | None = None, data_dir: str | None = "auto",
                 chunk_size: int | None = None, **model_args):
        from ..models import load_model  # heavy: transformers' model classes (torch._dynamo, triton)

        # Every setting is read into a run spec and checked before the model loads, by the checks run.py's
        # configuration meets (RunSpec.from_model_args); the model_args it does not read are HFLM's.
        self.data_dir = resolve_data_dir(data_dir)
        self.spec, hflm_kwargs = RunSpec.from_model_args(
            pretrained, data_dir_path=str(self.data_dir) if self.data_dir else None, **model_args)
        check_decode_batch(hflm_kwargs.get("decode_batch"))
        self.chunk_size = chunk_size
        model_spec = self.spec.model
        model, tokenizer, info = load_model(pretrained, dtype=model_spec.dtype, device=model_spec.device,
                                            device_map=model_spec.device_map, revision=model_spec.revision)
        self.info = info
        super().__init__(pretrained=model, tokenizer=tokenizer, **hflm_kwargs)
        check_supported(model)  # sinks, or attention that bypasses the interface: refused before any request
        sparse, calib = self.spec.sparsifier, self.spec.calib or CalibSpec()
        builders.check_sparsifies(sparse.settings, info.num_layers, self.max_length, info.name, info.num_heads)
        self.thresholds, self.thresholds_path = None, None
        if thresholds is not None:
            self.thresholds = Thresholds.load(thresholds, model, lookup=calib.lookup, beyond=calib.beyond)
            self.thresholds_path = str(thresholds)
            self._check_file_settings(f"thresholds={thresholds}", info.num_layers)
        elif self.needs_thresholds:  # a model folder that carries its own (Thresholds.save_pretrained)
            wanted = {"k_per_layer": self._k_per_layer(info.num_layers), "placement": sparse.placement,
                      "granularity": calib.granularity, "sigma_add": calib.sigma_add,
                      "calibration_documents": calib.num_samples, "cover_shots": calib.cover_shots,
                      "fewshot_sampler": calib.fewshot_sampler,
                      **({"calibration_task": calib.task} if calib.task else {})}
            found = (matching(pretrained, wanted, model, lookup=calib.lookup, beyond=calib.beyond)
                     if isinstance(pretrained, str) else None)
            if found is not None:
                self.thresholds, self.thresholds_path = found
        self.task_stats: dict[str, Any] = {}
        self._warned: set[str] = set()  # tasks whose unintended-run warnings were given (guards.warn_unintended)

    @property
    def needs_thresholds(self) -> bool:
        return self.spec.calib is not None  # the spec holds a calibration only for runs that need thresholds

    def _k_per_layer(self, num_layers: int) -> list[int]:
        sparse = self.spec.sparsifier
        return [sparse.layer_k.get(layer, sparse.k) for layer in range(num_layers)]

    def _check_file_settings(self, source: str, num_layers: int) -> None:
        """A thresholds file calibrated for another k, layer_k or placement is refused: Top-θ would keep the file's
        k while the report names the requested one."""
        if not self.needs_thresholds:
            return
        meta = self.thresholds.metadata
        layer_k = "+".join(f"{a}:{b}" for a, b in (meta.get("layer_k") or {}).items()) or "none"
        fix = (f"pass the file's settings (k={meta.get('k')},layer_k={layer_k},placement={self.thresholds.placement}), "
               "or drop thresholds= to calibrate for these")
        check_settings(self.thresholds, self._k_per_layer(num_layers), self.spec.sparsifier.placement, source, fix)

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
        return self.spec.sparsifier.build(self.thresholds), self.spec.comp.objects(self.thresholds)

    def _calibrate(self, tasks: list[str]):
        """Cached thresholds for these settings, calibrated now unless a job has (thresholds_cache.obtain_thresholds)."""
        calib = {**self.spec.calib.settings, "task": self.spec.calib.task or self._calibration_task(tasks)}
        model = {"name": self.info.name, "source": self.info.source, "revision": self.info.revision,
                 "dtype": str(self._model.dtype).removeprefix("torch."), "max_length": self.max_length}
        self.spec = dataclasses.replace(self.spec, calib=CalibSpec.from_settings(calib))
        spec = RunSpec.for_thresholds(model=model, sparsifier=self.spec.sparsifier.settings,
                                      comp=self.spec.comp.settings, calib=calib, data_dir_path=self.spec.data_dir_path)
        log.info("toptheta: thresholds for k=%s, placement=%s from %s's train split", spec.sparsifier.k,
                 spec.sparsifier.placement, calib["task"])
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
            "sparsifier": self.spec.sparsifier.settings,
            "comp": self.spec.comp.settings,
            "calibration": ({**self.spec.calib.settings, "thresholds": self.thresholds_path}
                            if self.needs_thresholds else None),
            "stats": {task: {**s.summary(), "per_layer": s.per_layer()} for task, s in self.task_stats.items()},
        }

    def warn_unintended(self) -> None:
        """run.py's warnings (guards.py), once per task: a sparse task that kept nearly every attention element,
        and rows longer than any calibrated row."""
        for task, stats in self.task_stats.items():
            if task not in self._warned:
                self._warned.add(task)
                warn_unintended(f"toptheta-eval {task}", self.spec.sparsifier.settings,
                                self.spec.calib.settings if self.needs_thresholds else None, stats, self.thresholds)

    def get_model_info(self) -> dict:
        """lm-eval asks for this once, after the evaluation: the report, and the warnings its statistics call for."""
        self.warn_unintended()
        return {**super().get_model_info(), "toptheta": self.toptheta_report()}
