"""One run, top to bottom: config -> model -> thresholds -> sparsified model -> evaluation -> results.

This is the only module that reads Hydra's DictConfig; everything it calls takes plain arguments.
``run(cfg)`` validates the whole configuration first (seconds, before any model loads), skips runs
whose identical configuration already finished (so interrupted sweeps resume), and evaluates a
dense baseline beside the sparse run so the printed table compares the two.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from . import sparsify
from .attention.backend import check_supported
from .attention.popularity import VRowPopularity
from .builders import check_combination, check_sparsifies, needs_thresholds, resolve_placement, searched_parameter
from .config import COMP_FIELDS, OPTIONAL_TASK_FIELDS, VROW_POPULARITY_DEFAULTS, check
from .evaluation.generation import Paused, check_context, check_decoding, evaluate_generation
from .evaluation.tasks import calibration_name, check_tasks, is_longbench
from .evaluation.tasks import resolve_data_dir as resolve
from .guards import warn_unintended
from .matched import kept_in_sparsified_layers, resolve_target
from .registry import LM_EVAL_KIND, active_compensations, sparsifier_kind, task_kind
from .results.wandb_logger import make_logger
from .spec import ModelSpec, RunSpec, TaskSpec, data_source
from .store.migrate import restore_summary, run_rows
from .store.provenance import code_commit
from .store.runs import RunStore
from .thresholds_cache import obtain_thresholds, thresholds_claim

log = logging.getLogger("toptheta")


# ---- validation: everything that can fail without a model ------------------------------------------

def resolve_data_dir(value) -> str | None:
    """``auto``: $TOPTHETA_DATA_DIR, else the data shipped in toptheta/data; ``hub`` or null: the hub (None)."""
    path = resolve(value)
    return None if path is None else str(path)


def plan(cfg: DictConfig) -> list[RunSpec]:
    """Validate the configuration and list the runs it asks for (baseline first).

    Types and choices were checked when Hydra composed `cfg` into toptheta.config's schema; ranges are
    checked here first, then combinations, tasks and data files, all before any model loads.
    """
    check(cfg)
    c = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    sparsifier, comp, task, calib = c["sparsifier"], dict(c["comp"]), c["task"], c["calib"]
    # Settings of compensations registered after CompConfig's fields (null when off) stay out of the run identity.
    comp = {key: v for key, v in comp.items() if not (v is None and key not in COMP_FIELDS)}
    # Fields only some task kinds use stay out of the run identity when unset (stable ids across schema growth).
    task = {key: v for key, v in task.items() if not (v is None and key in OPTIONAL_TASK_FIELDS)}
    prefix_cache = bool(task.pop("prefix_cache", True))  # how scoring runs, not what it scores: not in the run id
    notes = []
    kind = sparsifier_kind(sparsifier["name"])
    if not kind.drops and active_compensations(comp):
        notes.append("dense attention drops nothing: compensation ignored (comp=none)")
        comp = {"sdc": None, "sdc_scale": 1.0, "vmc": False}
    placement = resolve_placement(sparsifier, comp)
    check_combination(sparsifier["name"], placement, comp)

    data_dir = resolve_data_dir(c.get("data_dir", "auto"))
    calibrated = needs_thresholds(sparsifier, comp)
    calib_task = (calib.get("task") or task.get("calib_task")) if calibrated else None
    _check_tasks(task, calib_task, data_dir)
    if sparsifier.get("target_task"):  # the rows matched sparsity is resolved on: one of our calibration tasks
        check_tasks([calibration_name(sparsifier["target_task"])], Path(data_dir) if data_dir else None, None)

    model = {key: c["model"].get(key) for key in ("name", "source", "dtype", "device", "device_map", "revision",
                                                  "max_length", "chat_template")}
    evaluation = {key: v for key, v in task.items()}
    base = {"model": model, "task": evaluation, "data_dir": data_source(data_dir), "seed": c.get("seed")}
    store = RunStore(c["results_dir"])
    specs = []
    if c.get("baseline", True) and kind.drops:
        # Dense attention keeps every V row: its popularity is no record, and without it sparse runs recording
        # other layers share one baseline.
        dense_base = {**base, "task": {k: v for k, v in evaluation.items() if k != "vrow_popularity"}}
        specs.append(_spec(store, dense_base, {"name": "dense", "placement": None, "k": None, "layer_k": {}},
                           {"sdc": None, "sdc_scale": 1.0, "vmc": False}, None, "dense"))
    calib_cfg = None
    if calibrated:
        calib_cfg = {**calib, "task": calib_task,
                     "num_fewshot": calib.get("num_fewshot") if calib.get("num_fewshot") is not None
                     else task.get("num_fewshot")}
        if task.get("fewshot_sampler") not in (None, "default"):  # calibration rows built as the evaluated ones
            calib_cfg["fewshot_sampler"] = task["fewshot_sampler"]
        for key, before in (("beyond", "clamp"), ("cover_shots", 0), ("max_length", None)):  # options at what they
            if calib_cfg.get(key, before) == before:  # did before they existed: run ids stay as they were
                calib_cfg.pop(key, None)
    label = f"{sparsifier['name']}-{placement}" if kind.drops else sparsifier["name"]
    sparse = {**sparsifier, "placement": placement, "layer_k": {int(a): int(b) for a, b in (sparsifier.get("layer_k") or {}).items()}}
    for key in [key for key in sparse if key not in ("name", "placement", "k", "layer_k", "target_kept")]:
        if sparse[key] is None:  # fields of other kinds (Top-θ's empty_rows, p, lam): run ids stay as they were
            sparse.pop(key)
    target_rows = None
    if sparse.get("target_kept") is None:  # runs given by k keep the ids they had before the knob existed
        sparse.pop("target_kept", None)
    else:  # matched sparsity: k (a baseline's p or λ) is resolved on calibration rows built as the evaluated ones
        sparse[getattr(searched_parameter(sparse), "key", "k")] = None
        if sparse.get("target_task") is None and task.get("kind") != LM_EVAL_KIND \
                and task_kind(task["kind"]).target_prompts is not None:
            # a generation task that builds prompts: rows of its own shape (ruler: another draw of its generator;
            # HumanEval: python_code functions in its instruction), registry.TaskKindEntry.target_prompts
            target_rows = {"task": task["name"], "kind": task["kind"], "seed": calib.get("seed", 0)}
        else:
            target_rows = {"task": sparse.get("target_task") or calib_task or task.get("calib_task")
                                   or _evaluated_task(task),
                           "num_fewshot": calib_cfg["num_fewshot"] if calib_cfg else task.get("num_fewshot"),
                           "num_samples": calib.get("num_samples"), "seed": calib.get("seed", 0),
                           "fewshot_sampler": task.get("fewshot_sampler")}
    specs.append(_spec(store, {**base, **({"target": target_rows} if target_rows else {})}, sparse, comp, calib_cfg,
                       label))
    specs[-1].notes = notes
    for spec in specs:
        spec.data_dir_path = data_dir  # not part of the run id: the same data can live anywhere
        spec.log_samples = bool(c["log_samples"])
    return [spec.with_task(prefix_cache=prefix_cache) for spec in specs]  # nor this (after the id)


def _evaluated_task(task: dict) -> str | None:
    return task.get("lm_eval_task") if task.get("kind") == "lm_eval" else None


def _spec(store, base: dict, sparsifier: dict, comp: dict, calib: dict | None, label: str) -> RunSpec:
    identity = {**base, "sparsifier": sparsifier, "comp": comp, "calib": calib}
    return RunSpec.from_identity(identity, run_id=store.run_id_for(identity), label=label)


def _check_tasks(task: dict, calib_task: str | None, data_dir: str | None) -> None:
    """Task names and data files, checked by the task catalog before any model loads.

    A name outside our catalogue is any lm-eval task (its own data source) or one of the user's YAMLs under
    task.include_path; thresholds are always calibrated on one of ours (calib.task / task.calib_task).
    """
    from .evaluation.lm_eval_adapter import check_external_tasks, is_catalogued  # lm-eval: heavy, only when checking

    root = Path(data_dir) if data_dir else None
    if task["kind"] == "lm_eval" and is_catalogued(task["lm_eval_task"]):
        check_tasks([task["lm_eval_task"]], root, task.get("num_fewshot"))
    elif task["kind"] == "lm_eval":
        log.info("%s is not in toptheta's catalogue: looking it up among lm-eval's tasks", task["lm_eval_task"])
        check_external_tasks([task["lm_eval_task"]], task.get("include_path"))
    if calib_task:
        check_tasks([calibration_name(calib_task)], root, None)


# ---- evaluation ----------------------------------------------------------------------------------------------

def evaluate(task: TaskSpec, model, tokenizer, data_dir: str | None, model_spec: ModelSpec, log_samples: bool = False,
             stats=None, checkpoint: Path | None = None, stop=None) -> dict:
    """lm-eval's results dict (or the same shape for our generation tasks, which may add ``task_stats``: the
    statistics of sub-tasks such as one passkey length, cut from the session's ``stats``; and ``resumed``: the
    parts read back from ``checkpoint``, a directory where passkey saves each finished length; ``stop`` is asked
    between those parts whether to pause, raising generation.Paused)."""
    if task.kind == LM_EVAL_KIND:
        from .evaluation.lm_eval_adapter import clip_samples, evaluate_tasks  # lm-eval: heavy, lm_eval tasks only

        # Chat models get their template on generation tasks (LongBench's convention), never on
        # multiple-choice ones, whose scores compare loglikelihoods of raw continuations.
        chat = model_spec.chat_template and is_longbench(task.lm_eval_task)
        results = evaluate_tasks(model, tokenizer, [task.lm_eval_task], data_dir=data_dir,
                                 num_fewshot=task.num_fewshot, limit=task.limit,
                                 batch_size=task.batch_size, max_length=task.max_length,
                                 chat_template=chat, include_path=task.include_path, log_samples=log_samples,
                                 decode_batch=task.decode_batch or 1,  # in the run id; batch_size is not
                                 fewshot_sampler=task.fewshot_sampler, prefix_cache=task.prefix_cache)
        _count_generated(results, tokenizer)  # before clipping: a long response would count short
        if results.get("samples"):  # stored per run: few-shot prompts and long contexts clipped
            results["samples"] = clip_samples(results["samples"])
        return results
    results = evaluate_generation(task.settings, model, tokenizer, chat_template=model_spec.chat_template, stats=stats,
                                  checkpoint=checkpoint, stop=stop)
    return _count_generated(results, tokenizer)


def _count_generated(results: dict, tokenizer) -> dict:
    """Add ``generated_tokens``, the mean length in tokens of the generated texts, to a generation task's results:
    sparse attention can change how long a model talks (and so a run's cost and its score) as much as what it says.
    Multiple-choice tasks generate nothing and get none."""
    samples = results.get("samples") or []
    rows = [row for rows in samples.values() for row in rows] if isinstance(samples, dict) else list(samples)
    texts = []
    for row in rows:
        text, resps = row.get("generation"), row.get("resps")  # ours; lm-eval's generate_until: resps = [[text]]
        if text is None and resps and isinstance(resps[0], (list, tuple)) and resps[0]:
            text = resps[0][0]
        if isinstance(text, str):
            texts.append(text)
    if texts:
        results["generated_tokens"] = sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts) / len(texts)
    return results


def job_invocation() -> dict:
    """How this job was started (command line, Hydra overrides, sweep), saved in each run directory."""
    info = {"argv": list(sys.argv), "cwd": os.getcwd(), "host": socket.gethostname(), "pid": os.getpid()}
    from hydra.core.hydra_config import HydraConfig  # hydra: not loaded by `import toptheta.pipeline`

    if HydraConfig.initialized():
        hc = HydraConfig.get()
        info.update(overrides=list(hc.overrides.task), mode=str(hc.mode), job=hc.job.get("num"),
                    output_dir=hc.runtime.output_dir)
        if "MULTIRUN" in str(hc.mode):
            info["sweep"] = hc.sweep.dir
    return info


def _popularity_recorder(task: TaskSpec, model):
    """The task's V-row popularity recorder (task.vrow_popularity) and the KV group it stores, or (None, None)."""
    if task.vrow_popularity is None:
        return None, None
    popularity = {**VROW_POPULARITY_DEFAULTS, **task.vrow_popularity}
    recorder = VRowPopularity.for_model(model, int(popularity["layer"]), max_steps=popularity["max_steps"])
    if not 0 <= int(popularity["group"]) < recorder.kv_heads:
        raise ValueError(f"task.vrow_popularity.group={popularity['group']}: this model has {recorder.kv_heads} "
                         f"KV groups (0..{recorder.kv_heads - 1})")
    return recorder, int(popularity["group"])


def execute(spec: RunSpec, model, tokenizer, store, logger, chunk_size=None, invocation: dict | None = None) -> list[dict]:
    recorder, group = _popularity_recorder(spec.task, model)  # bad settings fail before calibration
    planned, (spec, target) = spec, resolve_target(spec, model, tokenizer)  # matched sparsity: k resolved here
    thresholds, thresholds_ref = (None, None)
    if spec.calib is not None:
        with thresholds_claim(spec, model):
            thresholds, thresholds_ref = obtain_thresholds(spec, model, tokenizer)
    sparsifier = spec.sparsifier.build(thresholds)
    comp = spec.comp.objects(thresholds)
    log.info("evaluating %s: %r + %s", spec.label, sparsifier, comp or "no compensation")
    t0 = time.time()
    # An interrupted run resumes from the parts it saved (passkey: each length); a popularity recording follows
    # the first generation of the run, so it starts over.
    checkpoint = store.partial_dir(spec.run_id) if recorder is None else None
    with sparsify(model, sparsifier, comp, chunk_size=chunk_size, observer=recorder) as stats:
        results = evaluate(spec.task, model, tokenizer, spec.data_dir_path, spec.model,
                           log_samples=spec.log_samples, stats=stats, checkpoint=checkpoint,
                           stop=lambda: stop_requested(store.results_dir))
    summary = {**stats.summary(), **results.pop("task_stats", {}), "seconds": time.time() - t0}
    resumed = results.pop("resumed", {})
    if resumed:  # the seconds the read-back parts took when they ran
        summary.update(seconds=summary["seconds"] + sum(resumed.values()), resumed_parts=sorted(resumed))
    if "generated_tokens" in results:
        summary["generated_tokens"] = results.pop("generated_tokens")
    summary["kept_attention_fraction_sparsified"] = kept_in_sparsified_layers(stats, spec.sparsifier)
    if target is not None:
        summary["target"] = target  # what target_kept chose: k, the calibration rows' kept fraction, the k tried
    extra_stats = {"vrow_popularity": recorder.to_dict(group)} if recorder is not None else {}
    warn_unintended(spec.label, spec.sparsifier.settings, spec.calib.settings if spec.calib else None, stats, thresholds)
    config = planned.stored_config()  # as planned: the run id's source
    run_dir = store.write_run(spec.run_id, config=config, lm_eval_results=results,
                              stats={**summary, "per_layer": stats.per_layer(), **extra_stats},
                              thresholds_ref=thresholds_ref, extra={"label": spec.label},
                              texts={"invocation.json": json.dumps(invocation or {}, indent=2, default=str) + "\n"},
                              copies={"thresholds.safetensors": thresholds_ref} if thresholds_ref else None)
    rows = run_rows(run_dir)  # read back from what was stored, as a rebuild of summary.csv reads it (store/migrate.py)
    store.append_summary(rows)
    if checkpoint is not None:
        shutil.rmtree(checkpoint, ignore_errors=True)  # the run is stored: its parts are no longer needed
    logger.log_run(spec, rows, stats, thresholds_ref)
    return rows


STOP_FILE = "STOP"


def stop_file(results_dir: str | Path) -> Path:
    """`<results_dir>/STOP`: while it exists, runs in progress finish and no new one starts (a sweep's remaining
    jobs skip theirs), so a long sweep can be stopped without losing the run in hand; delete it and rerun the
    sweep's command to go on. A run that saves its parts (passkey: each length) pauses at the next part instead
    and resumes there."""
    return Path(results_dir) / STOP_FILE


def stop_requested(results_dir: str | Path) -> bool:
    return stop_file(results_dir).exists()


def _restore_summary(store, spec: RunSpec, held: bool = False) -> None:
    """A stored run whose summary rows are missing (its job was killed between the two writes) gets them back from
    its directory, under its claim (a job still writing the run holds it: then nothing is done here)."""
    with contextlib.nullcontext(True) if held else store.claim(spec.run_id, wait=False) as mine:
        restored = restore_summary(store, spec.run_id) if mine else 0
    if restored:
        log.warning("%s: run %s was stored but summary.csv lacked its rows (an interrupted job); restored %d row(s) "
                    "from its directory", spec.label, spec.run_id, restored)


def run(cfg: DictConfig):
    """The main flow of ``python run.py``; returns the comparison table (a pandas DataFrame)."""
    from .models import load_model  # heavy: transformers' model classes (torch._dynamo, triton)
    from .results.summary import load_summary  # pandas: not loaded by `import toptheta.pipeline`
    from .results.tables import comparison_table  # pandas

    started = time.time()
    code_commit()  # the code this process loaded: what its runs record, even if the checkout moves on meanwhile
    specs = plan(cfg)  # fails here, in seconds, on anything wrong with the configuration
    for spec in specs:
        for note in spec.notes:
            log.warning(note)
    store = RunStore(cfg.results_dir)
    todo = [s for s in specs if cfg.force or not store.exists(s.run_id)]
    for spec in specs:
        if spec not in todo:
            log.info("%s: identical run %s already finished; skipping (force=true reruns it)", spec.label, spec.run_id)
            _restore_summary(store, spec)
    if todo and stop_requested(cfg.results_dir):
        log.warning("%s exists: not starting %d run(s) (remove it to go on)", stop_file(cfg.results_dir), len(todo))
        todo = []
    if todo and str(cfg.task.kind) != LM_EVAL_KIND:  # what a generation task refuses before anything loads
        before_load = task_kind(str(cfg.task.kind)).before_load
        if before_load is not None:
            before_load(OmegaConf.to_container(cfg.task, resolve=True, enum_to_str=True))
    if todo:
        m = cfg.model
        model, tokenizer, info = load_model(m.source, dtype=m.dtype, device=m.device, device_map=m.device_map,
                                            revision=m.revision)
        model.eval()
        check_supported(model)  # sinks, or attention that bypasses the interface: refused before any evaluation
        longest_row = cfg.task.max_length or m.max_length or info.max_position_embeddings
        check_sparsifies(specs[-1].sparsifier.settings, info.num_layers, longest_row, m.name, info.num_heads)
        if cfg.task.kind != "lm_eval":
            task = OmegaConf.to_container(cfg.task, resolve=True, enum_to_str=True)
            check_context(task, info.max_position_embeddings, m.name)
            check_decoding(task, model)
        job = job_invocation()
        logger = make_logger(OmegaConf.to_container(cfg.logger, resolve=True, enum_to_str=True),
                             {"sweep": job.get("sweep"), "job": f"job{job['job']}" if job.get("sweep") else None})
        try:
            with torch.no_grad():
                # The claim makes parallel jobs (a sweep's launcher, several shells) compute each run once. A run
                # another job holds (typically the dense baseline every job of a sweep shares) is put off: this job
                # runs its own configuration first instead of idling, then waits for the other's and reuses it.
                queue, deferred = [(spec, False) for spec in todo], []
                while queue:
                    spec, wait = queue.pop(0)
                    if stop_requested(cfg.results_dir):  # finish the run in hand, start no other
                        log.warning("%s exists: stopping before %s (remove it to go on)", stop_file(cfg.results_dir),
                                    spec.label)
                        break
                    with store.claim(spec.run_id, wait=wait) as held:
                        if not held:
                            deferred.append((spec, True))
                            if not queue:
                                queue, deferred = deferred, []
                            continue
                        if store.exists(spec.run_id) and (not cfg.force or store.finished_since(spec.run_id, started)):
                            log.info("%s: run %s was computed by another job meanwhile; reusing it",
                                     spec.label, spec.run_id)
                            _restore_summary(store, spec, held=True)
                        else:
                            try:
                                execute(spec, model, tokenizer, store, logger, chunk_size=cfg.get("chunk_size"),
                                        invocation=job)
                            except Paused as paused:
                                log.warning("%s exists: %s paused (%s); remove it and rerun to resume",
                                            stop_file(cfg.results_dir), spec.label, paused)
                                break
                    if not queue:
                        queue, deferred = deferred, []
        finally:
            logger.finish()
    table = comparison_table(load_summary(cfg.results_dir), [s.run_id for s in specs])
    print(table.to_string(index=False))
    where = Path(cfg.results_dir).resolve()
    print(f"results: {where / 'summary.csv'} and {where / 'runs'}/<run_id>/ "
          f"(runs {', '.join(s.run_id for s in specs)})")
    return table
