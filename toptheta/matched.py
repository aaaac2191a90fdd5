"""Matched sparsity (``sparsifier.target_kept``): the k, p or λ at which a run keeps a target fraction of the
attention elements (or, with ``sparsifier.target_measure=vrows``, of the V rows read in decode steps: the generation
tasks' measure), resolved on its calibration rows before it evaluates (see calibration/target_kept.py and
calibration/target_param.py for the searches), and the kept fraction of the layers that setting governs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import sparsify
from .atomic import write_text_atomic
from .attention.stats import SparsityStats
from .builders import needs_thresholds, searched_parameter
from .cachedir import cache_dir, identity_key
from .calibration.target_kept import TOLERANCE, Unreachable, resolve_k
from .calibration.target_param import fit_parameter, log_slope
from .evaluation.greedy import encode_prompt
from .evaluation.model_facts import has_sliding_window, layer_windows
from .evaluation.prefix_cache import run_shared
from .evaluation.prefix_sharing import generate_shared
from .registry import Parameter, sparsifier_kind, task_kind
from .spec import SparsifierSpec
from .thresholds.table import model_fingerprint
from .thresholds_cache import obtain_thresholds, thresholds_claim, thresholds_filed

if TYPE_CHECKING:
    from .spec import RunSpec

log = logging.getLogger("toptheta")


def kept_in_sparsified_layers(stats, sparsifier: SparsifierSpec) -> float | None:
    """The kept attention fraction over the layers sparsifier.k governs (those not in layer_k); None for dense."""
    if not sparsifier_kind(sparsifier.name).drops:
        return None
    free = [layer for layer in range(stats.num_layers) if layer not in (sparsifier.layer_k or {})]
    valid = float(stats.prefill_valid[free].sum()) if free else 0.0
    return float(stats.prefill_kept[free].sum()) / valid if valid else None


MEASURE_SEQUENCES = 32  # calibration rows Top-θ's kept fraction is measured on, per k tried
VROW_SEQUENCES = 16  # target_measure=vrows: calibration rows decoded from, per setting tried
VROW_TOKENS = 8  # tokens decoded greedily after each of them, unless the task decodes them as its own (HumanEval)


def decode_after(model, prompts: list[list[int]], tokens: int, pad_token_id: int, *, progress: Path | None = None,
                 stats: SparsityStats | None = None) -> None:
    """Greedy decoding of exactly ``tokens`` tokens after each prompt (no end-of-sequence stop), inside the caller's
    ``sparsify`` block: what the V-row measure counts. Prompts that share prefixes (ruler's shared haystacks) run those
    once (``generate_shared``, the statistics counted once per prompt); a model with sliding-window layers, whose
    cache cannot be cut at a shared prefix, decodes each prompt through ``generate``.

    With ``progress`` (a file) and ``stats`` (the block's statistics), the counters are saved there as each prompt
    finishes, and a call that finds them (an interrupted measure: a 16-prompt measure of 8k-token prompts takes half
    an hour here) adds them to ``stats`` and runs only the prompts left, with the counts of an uninterrupted call."""
    done = _read_progress(progress, prompts, stats)

    def finished(i: int, _tokens=None) -> None:
        done.add(i)
        if progress is not None:
            write_text_atomic(progress, json.dumps({"prompts": _prompts_key(prompts), "done": sorted(done),
                                                    "stats": stats.to_json()}) + "\n")

    if has_sliding_window(model):
        for i, ids in enumerate(prompts):
            if i not in done:
                model.generate(torch.tensor([ids], device=model.device), max_new_tokens=tokens, min_new_tokens=tokens,
                               do_sample=False, pad_token_id=pad_token_id)
                finished(i)
        return
    generate_shared(model, prompts, max_new_tokens=[tokens] * len(prompts), pad_token_id=pad_token_id,
                    eos_token_ids=set(), on_finish=finished, done=frozenset(done))


def _prompts_key(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode("utf-8")).hexdigest()


def _read_progress(progress: Path | None, prompts: list[list[int]], stats: SparsityStats | None) -> set[int]:
    """The prompts an interrupted decode_after finished, their counters added to ``stats``; none without a file saved
    for these prompts."""
    if progress is not None and stats is None:
        raise ValueError("decode_after: progress needs the sparsify block's stats (they are what it saves)")
    if progress is None or not progress.is_file():
        return set()
    data = json.loads(progress.read_text(encoding="utf-8"))
    if data.get("prompts") != _prompts_key(prompts):
        log.warning("%s was saved for other prompts; measuring from the start", progress)
        return set()
    stats.add(SparsityStats.from_json(data["stats"]))
    log.info("target_kept: %d of %d prompts measured before the stop, read back from %s", len(data["done"]),
             len(prompts), progress.name)
    return set(data["done"])


def target_rows(spec: RunSpec, model, tokenizer) -> list[list[int]]:
    """The token ids of the calibration rows a matched run of a task scored by log-likelihood fits its parameter on
    (``spec.target``: train documents after their shots, none of them evaluated)."""
    from .evaluation.lm_eval_adapter import calibration_requests, hflm_max_length  # lm-eval: heavy, matched runs only

    rows = spec.target
    return calibration_requests(
        tokenizer, rows.task, data_dir=spec.data_dir_path, num_fewshot=rows.num_fewshot,
        limit=rows.num_samples, max_length=spec.model.max_length or hflm_max_length(model, tokenizer),
        seed=rows.seed, fewshot_sampler=rows.fewshot_sampler, draw=rows.seed)


def resolve_target(spec: RunSpec, model, tokenizer) -> tuple[RunSpec, dict | None]:
    """For a run with ``sparsifier.target_kept``: (a copy of ``spec`` with the k that keeps that fraction of the
    attention elements on its calibration rows, the record of the choice); other runs: (``spec``, None).

    Top-k's fraction follows from the rows' lengths; Top-θ's is measured with the thresholds of each k tried
    (calibrated and cached as any run's), starting at the k Top-k needs (on the V-row measure, Top-k's own fit first:
    ``topk_guide``); the baselines' p (top-p) or λ (skip-softmax) is bisected on the measured
    fraction (calibration/target_param.py). Fails with the fix when the target is out of reach."""
    target = spec.sparsifier.target_kept
    if target is None:
        return spec, None
    rows = spec.target
    vrows = spec.sparsifier.target_measure == "vrows"
    tolerance = spec.sparsifier.target_tolerance or TOLERANCE
    tolerance_record = {"target_tolerance": tolerance} if spec.sparsifier.target_tolerance else {}
    chat = spec.model.chat_template
    entry = task_kind(rows.kind) if rows.kind is not None else None
    decode_as_task = vrows and entry is not None and entry.target_decode is not None
    if entry is not None:  # the generation task's own prompts, another draw (ruler) or documents shaped as its own
        prompts = entry.target_prompts(spec.task.settings, tokenizer, VROW_SEQUENCES if vrows else MEASURE_SEQUENCES,
                                       rows.seed, chat_template=chat)
        sequences = [encode_prompt(tokenizer, p, chat_template=chat) for p in prompts]
    else:
        sequences = target_rows(spec, model, tokenizer)
    layer_k = spec.sparsifier.layer_k or {}
    num_layers = model.config.get_text_config().num_hidden_layers

    def with_value(k, key: str = "k", base: RunSpec = spec) -> RunSpec:  # sparsifier.<key> (k, p or lam) resolved
        return base.with_sparsifier(**{key: k})

    def measure(k, key: str = "k", base: RunSpec = spec) -> float:
        candidate = with_value(k, key, base)
        stored = measure_file(candidate, model, decode_as_task)
        if stored.is_file():  # measured before, by this run or another (Top-θ's start reuses Top-k's run's fit)
            kept = json.loads(stored.read_text())["kept"]
            log.info("target_kept=%g: %s %s=%g keeps %.4f (measured before: %s)", target,
                     sparsifier_kind(base.sparsifier.name).label, key, k, kept, stored.name)
            return kept
        thresholds = None
        if candidate.calib is not None:
            with thresholds_claim(candidate, model):
                thresholds, _ = obtain_thresholds(candidate, model, tokenizer)
        with torch.no_grad(), sparsify(model, candidate.sparsifier.build(thresholds),
                                       candidate.comp.objects(thresholds)) as stats:
            if decode_as_task:  # the generation task's own decoding (HumanEval: to the end of each answer)
                entry.target_decode(spec.task.settings, model, tokenizer, prompts[:VROW_SEQUENCES], chat_template=chat)
            elif vrows:  # the generation tasks' measure: V rows read in decode steps after each calibration row
                decode_after(model, sequences[:VROW_SEQUENCES], VROW_TOKENS,
                             tokenizer.pad_token_id or tokenizer.eos_token_id or 0, stats=stats,
                             progress=stored.with_suffix(".progress.json"))
            else:  # shared prefixes (fixed exemplars, a question's choices) run once, counted once per sequence
                run_shared(model, sequences[:MEASURE_SEQUENCES], stats.repeated)
        kept = stats.kept_vrow_fraction if vrows else stats.kept_attention_fraction
        if kept is None:
            if vrows:
                raise ValueError(f"target_kept={target}: no token was decoded after the {rows.task} prompts it is "
                                 "resolved on, so no V row was read: raise task.max_length above their lengths (the "
                                 f"longest {max(map(len, sequences))} tokens)")
            raise ValueError(f"target_kept={target}: the {rows.task} rows it is resolved on ran no prefill, so no "
                             "attention element was counted: give the task calibration documents (calib.num_samples)")
        log.info("target_kept=%g: %s %s=%g keeps %.4f of the %s on %d calibration rows", target,
                 sparsifier_kind(base.sparsifier.name).label, key, k, kept, "V rows" if vrows else "attention elements",
                 min(len(sequences), VROW_SEQUENCES if vrows else MEASURE_SEQUENCES))
        write_text_atomic(stored, json.dumps({"kept": kept, "k": k, "key": key}) + "\n")
        stored.with_suffix(".progress.json").unlink(missing_ok=True)
        return kept

    parameter = searched_parameter(spec.sparsifier.settings)
    if vrows and parameter is None:  # k by bisection on the measured V-row fraction (no closed form: heads' union)
        k_range = Parameter("k", 1, max(len(s) for s in sequences), log=True, keeps_more_when_higher=True)
        guide = None
        if spec.calib is not None and (stand_in := topk_stand_in(spec)) is not None:  # each k Top-θ tries is a
            # calibration: Top-k's fit, which only decodes, gives the start
            guide = topk_guide(target, k_range, lambda v: measure(max(1, round(v)), base=stand_in), tolerance)
        if guide is not None:  # a k near Top-k's whose thresholds exist already costs a decode, not a calibration
            start = calibrated_start(guide["k"], k_range, with_value, model, decode_as_task,
                                     thresholds_filed(model, tokenizer))
            if start != guide["k"]:
                log.info("target_kept=%g: Top-θ's search starts at k=%d, calibrated already, instead of Top-k's "
                         "k=%d", target, start, guide["k"])
                guide["calibrated"] = start
        value, kept, tried = fit_parameter(target, k_range, lambda v: measure(max(1, round(v))), tolerance=tolerance,
                                           **({"start": start, "slope": guide["slope"]} if guide else {}))
        k = max(1, round(value))
        log.info("target_kept=%g of the V rows: k=%d (kept %.4f in decode steps after the calibration rows of %s)",
                 target, k, kept, rows.task)
        return with_value(k), {"target_kept": target, "target_measure": "vrows", "k": k, "calibration_kept": kept,
                               "tried": [(max(1, round(v)), f) for v, f in tried],
                               "calibration_sequences": min(len(sequences), VROW_SEQUENCES),
                               "decoded": "as the task" if decode_as_task else f"{VROW_TOKENS} tokens",
                               **({"start": guide} if guide else {}), **tolerance_record}
    if parameter is not None:  # a rule with its own parameter (p, λ): that is bisected, k keeps only rows whole
        key = parameter.key
        value, kept, tried = fit_parameter(target, parameter, lambda v: measure(v, key), tolerance=tolerance,
                                           **parameter.guide(target))
        log.info("target_kept=%g: %s=%g (kept %.4f on the calibration rows of %s)", target, key, value, kept,
                 rows.task)
        return with_value(value, key), {"target_kept": target, key: value, "calibration_kept": kept,
                                        "tried": tried, "calibration_sequences": len(sequences),
                                        **({"target_measure": "vrows", "decoded": "as the task" if decode_as_task
                                            else f"{VROW_TOKENS} tokens"} if vrows else {}), **tolerance_record}
    k, kept, tried = resolve_k(target, [len(s) for s in sequences], layer_k, num_layers,
                               measure if spec.calib is not None else None, tolerance=tolerance,
                               windows=layer_windows(model))
    log.info("target_kept=%g: k=%d (kept %.4f on the calibration rows of %s)", target, k, kept, rows.task)
    return with_value(k), {"target_kept": target, "k": k, "calibration_kept": kept, "tried": tried,
                           "calibration_sequences": len(sequences), **tolerance_record}


# the settings a Top-k run of the same setting has (so its measures are the stand-in's: measure_file)
TOPK_SETTINGS = ("placement", "k", "layer_k", "target_kept", "target_measure", "target_task", "target_tolerance")


def topk_stand_in(spec: RunSpec) -> RunSpec | None:
    """Top-k with the run's placement, k, layer_k and compensation, calibrating nothing: what starts Top-θ's k search
    on the V-row measure (``resolve_k`` starts the attention measure's at Top-k's k as well). None when that
    compensation needs thresholds (calibrated SDC)."""
    settings = {"name": "topk", **{key: spec.sparsifier.settings[key] for key in TOPK_SETTINGS
                                   if key in spec.sparsifier.settings}}
    if needs_thresholds(settings, spec.comp.settings):
        return None
    return dataclasses.replace(spec, sparsifier=SparsifierSpec.from_settings(settings), calib=None,
                               notes=list(spec.notes))


def topk_guide(target: float, k_range: Parameter, measure, tolerance: float = TOLERANCE) -> dict | None:
    """Top-k's k for ``target`` (``measure``: its V-row fraction at a k) and the local slope of log(kept) against
    log k there (of the two values tried closest to the target), as the start of Top-θ's search; None when Top-k
    cannot reach the target (Top-θ's search then runs alone and says why it fails)."""
    try:
        value, kept, tried = fit_parameter(target, k_range, measure, tolerance=tolerance)
    except Unreachable:
        return None
    nearest = sorted(tried, key=lambda t: abs(math.log(max(t[1], 1e-12) / target)))[:2]
    return {"from": "topk", "k": max(1, round(value)), "kept": kept, "slope": log_slope(k_range, nearest),
            "tried": [(max(1, round(v)), f) for v, f in tried]}


NEAR_START = 1.5  # a calibrated k within this factor of Top-k's starts Top-θ's V-row search instead of Top-k's


def calibrated_start(k: int, k_range: Parameter, candidate, model, decode_as_task: bool, filed) -> int:
    """The k a Top-θ V-row search starts at: Top-k's ``k`` unless Top-θ's thresholds at ``k`` are neither measured
    nor cached and some k within a factor ``NEAR_START`` of it has them (the one nearest ``k`` on the log axis).
    ``candidate(k)``: the run's spec at that k; ``filed(spec)``: whether the cache holds its thresholds, under its key
    or the sequences' (``thresholds_cache.thresholds_filed``). Each k the search tries is a calibration
    unless its thresholds exist (6,511 s on ruler's long documents), and its first step from any start follows Top-k's
    slope, so a start a little off Top-k's k that is already calibrated saves a calibration. Thresholds a model
    folder carries are not looked for (``checkpoint_thresholds``): they are found when the search reaches their k."""
    def ready(value: int) -> bool:
        spec = candidate(value)
        return measure_file(spec, model, decode_as_task).is_file() or filed(spec)

    if ready(k):
        return k
    low = max(math.ceil(k_range.low), math.ceil(k / NEAR_START))
    high = min(math.floor(k_range.high), math.floor(k * NEAR_START))
    near = [value for value in range(low, high + 1) if value != k and ready(value)]
    return min(near, key=lambda value: (abs(math.log(value / k)), value), default=k)


MEASURE_VERSION = 1  # bump when what a measure counts changes: older stored measures are then not read


def measure_file(candidate: RunSpec, model, decode_as_task: bool) -> Path:
    """Where a kept fraction measured for ``candidate`` (a run's spec with k, p or λ set) is kept:
    ``$TOPTHETA_CACHE/target_measures/<model>/<key>.json``, the key a hash of all it depends on (the spec's identity,
    so its rows, sparsifier, compensation and calibration; the model's shape and device; how many rows the measure
    reads and how it decodes). A measure is a pass over the calibration rows or a decode of the target prompts:
    minutes on long rows, and Top-θ's V-row search repeats Top-k's (``topk_guide``), so each is done once."""
    settings = candidate.sparsifier.settings
    if "target_tolerance" in settings:  # how close a search must come, not what a measure counts: shared measures
        settings = {key: value for key, value in settings.items() if key != "target_tolerance"}
        candidate = dataclasses.replace(candidate, sparsifier=SparsifierSpec.from_settings(settings))
    identity = {"spec": candidate.identity(), "fingerprint": model_fingerprint(model), "device": str(model.device),
                "sequences": [MEASURE_SEQUENCES, VROW_SEQUENCES], "tokens": VROW_TOKENS, "as_task": decode_as_task,
                "version": MEASURE_VERSION}
    key = identity_key(identity)
    return cache_dir("target_measures", candidate.model.name or "model", f"{key}.json")
