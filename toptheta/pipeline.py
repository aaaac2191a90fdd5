"""One run, top to bottom: config -> model -> thresholds -> sparsified model -> evaluation -> results.

This is the only module that reads Hydra's DictConfig; everything it calls takes plain arguments.
``run(cfg)`` validates the whole configuration first (seconds, before any model loads), skips runs
whose identical configuration already finished (so interrupted sweeps resume), and evaluates a
dense baseline beside the sparse run so the printed table compares the two.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("toptheta")

SPARSIFIERS = ("dense", "topk", "toptheta")
SDC_ESTIMATORS = (None, "exact", "exp-threshold", "calibrated")
TASK_KINDS = ("lm_eval", "humaneval", "passkey")


@dataclass
class RunSpec:
    """One evaluation: what the results store keys on."""

    config: dict
    run_id: str = ""
    label: str = ""
    thresholds: dict | None = None  # calibration settings when the run needs thresholds
    notes: list = field(default_factory=list)


# ---- validation: everything that can fail without a model ------------------------------------------

def resolve_data_dir(value) -> str | None:
    """``auto``: $TOPTHETA_DATA_DIR, else ../shared/data beside the checkout if present, else None (hub)."""
    if value not in (None, "auto"):
        path = Path(str(value)).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"data_dir={value} is not a directory; point it at a folder laid out like "
                             "../shared/data, or set data_dir=null to use the Hugging Face hub")
        return str(path)
    if value is None:
        return None
    if os.environ.get("TOPTHETA_DATA_DIR"):
        return resolve_data_dir(os.environ["TOPTHETA_DATA_DIR"])
    beside = Path(__file__).resolve().parents[2] / "shared" / "data"
    return str(beside) if beside.is_dir() else None


def resolve_placement(sparsifier: dict, comp: dict) -> str | None:
    if sparsifier["name"] == "dense":
        return None
    placement = sparsifier.get("placement") or "auto"
    if placement == "auto":
        return "pre" if comp.get("sdc") else "post"
    placement = {"pre-softmax": "pre", "post-softmax": "post"}.get(placement, placement)
    if placement not in ("pre", "post"):
        raise ValueError(f"sparsifier.placement={placement!r}: use pre, post or auto")
    return placement


def plan(cfg: DictConfig) -> list[RunSpec]:
    """Validate the configuration and list the runs it asks for (baseline first)."""
    from .results.store import RunStore

    c = OmegaConf.to_container(cfg, resolve=True)
    sparsifier, comp, task, calib = c["sparsifier"], dict(c["comp"]), c["task"], c["calib"]
    if sparsifier["name"] not in SPARSIFIERS:
        raise ValueError(f"sparsifier.name={sparsifier['name']!r}; valid: {', '.join(SPARSIFIERS)}")
    if task.get("kind") not in TASK_KINDS:
        raise ValueError(f"task.kind={task.get('kind')!r}; valid: {', '.join(TASK_KINDS)}")
    if comp.get("sdc") not in SDC_ESTIMATORS:
        raise ValueError(f"comp.sdc={comp.get('sdc')!r}; valid: null, exact, exp-threshold, calibrated")
    notes = []
    if sparsifier["name"] == "dense" and (comp.get("sdc") or comp.get("vmc")):
        notes.append("dense attention drops nothing: compensation ignored (comp=none)")
        comp = {"sdc": None, "sdc_scale": 1.0, "vmc": False}
    if sparsifier["name"] != "dense":
        k = sparsifier.get("k")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"sparsifier.k={k!r}: give a positive integer, e.g. sparsifier.k=64")
    placement = resolve_placement(sparsifier, comp)
    _check_combination(sparsifier["name"], placement, comp)

    data_dir = resolve_data_dir(c.get("data_dir", "auto"))
    needs_thresholds = sparsifier["name"] == "toptheta" or comp.get("sdc") == "calibrated"
    calib_task = (calib.get("task") or task.get("calib_task")) if needs_thresholds else None
    _check_tasks(task, calib_task, data_dir)

    model = {key: c["model"].get(key) for key in ("name", "source", "dtype", "device", "device_map", "revision",
                                                  "max_length", "chat_template")}
    evaluation = {key: v for key, v in task.items()}
    base = {"model": model, "task": evaluation, "data_dir": "local" if data_dir else "hub", "seed": c.get("seed")}
    store = RunStore(c.get("results_dir", "results"))
    specs = []
    if c.get("baseline", True) and sparsifier["name"] != "dense":
        specs.append(_spec(store, base, {"name": "dense", "placement": None, "k": None, "layer_k": {}},
                           {"sdc": None, "sdc_scale": 1.0, "vmc": False}, None, "dense"))
    calib_cfg = None
    if needs_thresholds:
        calib_cfg = {**calib, "task": calib_task,
                     "num_fewshot": calib.get("num_fewshot") if calib.get("num_fewshot") is not None
                     else task.get("num_fewshot")}
    label = sparsifier["name"] if sparsifier["name"] == "dense" else f"{sparsifier['name']}-{placement}"
    sparse = {**sparsifier, "placement": placement, "layer_k": {int(a): int(b) for a, b in (sparsifier.get("layer_k") or {}).items()}}
    specs.append(_spec(store, base, sparse, comp, calib_cfg, label))
    specs[-1].notes = notes
    for spec in specs:
        spec.config["data_dir_path"] = data_dir  # not part of the run id: the same data can live anywhere
    return specs


def _spec(store, base: dict, sparsifier: dict, comp: dict, calib: dict | None, label: str) -> RunSpec:
    config = {**base, "sparsifier": sparsifier, "comp": comp, "calib": calib}
    return RunSpec(config=config, run_id=store.run_id_for(config), label=label, thresholds=calib)


def _check_combination(name: str, placement: str | None, comp: dict) -> None:
    """Build the compensation objects against a stand-in sparsifier: the library's own checks speak."""
    from .compensation import check_compensation

    if name == "dense":
        return
    stand_in = SimpleNamespace(placement=placement)
    if name == "toptheta" or comp.get("sdc") == "calibrated":
        stand_in.thresholds = SimpleNamespace(sdc_mass=True)
    check_compensation(stand_in, _compensation(comp, thresholds=stand_in.__dict__.get("thresholds")))


def _check_tasks(task: dict, calib_task: str | None, data_dir: str | None) -> None:
    """Task names and data files, checked by the task catalog before any model loads."""
    from .evaluation.tasks import calibration_name, check_tasks

    root = Path(data_dir) if data_dir else None
    if task["kind"] == "lm_eval":
        check_tasks([task["lm_eval_task"]], root, task.get("num_fewshot"))
    if calib_task:
        check_tasks([calibration_name(calib_task)], root, None)


# ---- building library objects from plain dicts ----------------------------------------------------------

def _compensation(comp: dict, thresholds=None) -> list:
    from .compensation import SDC, VMC

    out = []
    if comp.get("sdc"):
        out.append(SDC(comp["sdc"], scale=float(comp.get("sdc_scale", 1.0)), thresholds=thresholds))
    if comp.get("vmc"):
        out.append(VMC())
    return out


def build_sparsifier(sparsifier: dict, thresholds=None):
    from . import Dense, TopK, TopTheta

    if sparsifier["name"] == "dense":
        return Dense()
    if sparsifier["name"] == "topk":
        return TopK(sparsifier["k"], sparsifier["placement"], sparsifier.get("layer_k"))
    return TopTheta(thresholds, sparsifier["placement"])


# ---- thresholds: calibrated once per key, cached ------------------------------------------------------------

def thresholds_key(spec: RunSpec, fingerprint: dict) -> str:
    calib = {k: v for k, v in spec.thresholds.items() if k not in ("lookup", "smooth_sigma")}
    sparsifier = spec.config["sparsifier"]
    identity = {"model": spec.config["model"]["source"], "revision": spec.config["model"]["revision"],
                "dtype": spec.config["model"]["dtype"], "fingerprint": fingerprint, "k": sparsifier["k"],
                "layer_k": sparsifier.get("layer_k"), "placement": sparsifier["placement"], "calib": calib,
                "data": spec.config["data_dir"], "max_length": spec.config["model"]["max_length"]}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def thresholds_dir() -> Path:
    root = os.environ.get("TOPTHETA_CACHE") or Path.home() / ".cache" / "toptheta"
    return Path(root) / "thresholds"


def obtain_thresholds(spec: RunSpec, model, tokenizer):
    """Load cached thresholds for this calibration key, or calibrate and cache them."""
    from .calibration import Thresholds, calibrate, model_fingerprint
    from .evaluation.lm_eval_adapter import calibration_requests, hflm_max_length

    calib, sparsifier = spec.thresholds, spec.config["sparsifier"]
    path = thresholds_dir() / spec.config["model"]["name"] / f"{thresholds_key(spec, model_fingerprint(model))}.safetensors"
    options = {"lookup": calib.get("lookup", "nearest"), "smooth_sigma": calib.get("smooth_sigma", 0.0)}
    if path.is_file():
        log.info("thresholds: reusing %s", path)
        return Thresholds.load(path, model, **options), str(path)
    max_length = spec.config["model"].get("max_length") or hflm_max_length(model, tokenizer)
    requests = calibration_requests(tokenizer, calib["task"], data_dir=spec.config["data_dir_path"],
                                    num_fewshot=calib.get("num_fewshot"), limit=calib.get("num_samples"),
                                    max_length=max_length, seed=calib.get("seed", 0))
    log.info("calibrating on %d sequences of %s (train split)", len(requests), calib["task"])
    t0 = time.time()
    thresholds = calibrate(
        model, [[r] for r in requests], k=sparsifier["k"], placement=sparsifier["placement"],
        layer_k=sparsifier.get("layer_k"), statistic=calib.get("statistic", "order"),
        sigma_add=calib.get("sigma_add", 0.1), granularity=calib.get("granularity", "layer-head-n"),
        tac=calib.get("tac", True), sample_frac=calib.get("sample_frac", 1.0), seed=calib.get("seed", 0),
        generate_tokens=int(calib.get("decode_tokens") or 0),
        metadata={"model": spec.config["model"]["source"], "revision": spec.config["model"]["revision"],
                  "calibration_task": calib["task"], "calibration_split": "train",
                  "calibration_documents": calib.get("num_samples"), "num_fewshot": calib.get("num_fewshot")},
        **options,
    )
    thresholds.save(path)
    log.info("calibrated in %.0f s -> %s (%d bytes)", time.time() - t0, path, thresholds.nbytes())
    return thresholds, str(path)


# ---- evaluation ----------------------------------------------------------------------------------------------

def evaluate(task: dict, model, tokenizer, data_dir: str | None, model_cfg: dict) -> dict:
    """lm-eval's results dict (or the same shape for our generation tasks)."""
    if task["kind"] == "lm_eval":
        from .evaluation.lm_eval_adapter import evaluate_tasks
        from .evaluation.tasks import is_longbench

        # Chat models get their template on generation tasks (LongBench's convention), never on
        # multiple-choice ones, whose scores compare loglikelihoods of raw continuations.
        chat = bool(model_cfg.get("chat_template")) and is_longbench(task["lm_eval_task"])
        return evaluate_tasks(model, tokenizer, [task["lm_eval_task"]], data_dir=data_dir,
                              num_fewshot=task.get("num_fewshot"), limit=task.get("limit"),
                              batch_size=task.get("batch_size", 1), max_length=task.get("max_length"),
                              chat_template=chat)
    from .evaluation.generation import evaluate_generation

    return evaluate_generation(task, model, tokenizer, chat_template=bool(model_cfg.get("chat_template")))


def execute(spec: RunSpec, model, tokenizer, store, logger, chunk_size=None) -> list[dict]:
    from . import sparsify
    from .results.store import summary_rows

    thresholds, thresholds_ref = (None, None)
    if spec.thresholds is not None:
        thresholds, thresholds_ref = obtain_thresholds(spec, model, tokenizer)
    sparsifier = build_sparsifier(spec.config["sparsifier"], thresholds)
    comp = _compensation(spec.config["comp"], thresholds)
    log.info("evaluating %s: %r + %s", spec.label, sparsifier, comp or "no compensation")
    t0 = time.time()
    with sparsify(model, sparsifier, comp, chunk_size=chunk_size) as stats:
        results = evaluate(spec.config["task"], model, tokenizer, spec.config["data_dir_path"], spec.config["model"])
    summary = {**stats.summary(), "seconds": time.time() - t0}
    config = {k: v for k, v in spec.config.items() if k != "data_dir_path"}
    store.write_run(spec.run_id, config=config, lm_eval_results=results, stats={**summary, **stats.per_layer()},
                    thresholds_ref=thresholds_ref, extra={"label": spec.label})
    rows = summary_rows(spec.run_id, config, results, summary)
    store.append_summary(rows)
    logger.log_run(spec, rows, stats)
    return rows


def run(cfg: DictConfig):
    """The main flow of ``python run.py``; returns the comparison table (a pandas DataFrame)."""
    from .models import load_model
    from .results.store import RunStore, load_summary
    from .results.tables import comparison_table
    from .results.wandb_logger import make_logger

    specs = plan(cfg)  # fails here, in seconds, on anything wrong with the configuration
    for spec in specs:
        for note in spec.notes:
            log.warning(note)
    store = RunStore(cfg.results_dir)
    todo = [s for s in specs if cfg.force or not store.exists(s.run_id)]
    for spec in specs:
        if spec not in todo:
            log.info("%s: identical run %s already finished; skipping (force=true reruns it)", spec.label, spec.run_id)
    if todo:
        m = cfg.model
        model, tokenizer, info = load_model(m.source, dtype=m.dtype, device=m.device, device_map=m.device_map,
                                            revision=m.revision)
        model.eval()
        if cfg.task.kind != "lm_eval":
            from .evaluation.generation import check_context

            check_context(OmegaConf.to_container(cfg.task, resolve=True), info.max_position_embeddings, m.name)
        logger = make_logger(OmegaConf.to_container(cfg.logger, resolve=True), OmegaConf.to_container(cfg, resolve=True))
        try:
            import torch

            with torch.no_grad():
                for spec in todo:
                    execute(spec, model, tokenizer, store, logger, chunk_size=cfg.get("chunk_size"))
        finally:
            logger.finish()
    table = comparison_table(load_summary(cfg.results_dir), [s.run_id for s in specs])
    print(table.to_string(index=False))
    return table
