"""Typed configuration: one dataclass schema per config group (conf/<group>/*.yaml), in Hydra's ConfigStore.

conf/config.yaml lists `config_schema` first in its defaults, so Hydra merges every group's YAML and every
command-line override into these dataclasses: a wrong type (`sparsifier.k=abc`), an unknown key or an
invalid choice (`calib.granularity=layerhead`) fails while the configuration is composed, in seconds, and
OmegaConf's message lists the valid values. Ranges that types cannot express (`task.batch_size=-1`,
`sparsifier.k=0`) are checked by `check(cfg)`, which pipeline.plan calls before anything else.

Choices are Enums whose member names equal their values ("layer-head-n"), so a YAML, an override and an
error message all spell a value the same way; they are `str` subclasses, so `cfg.task.kind == "lm_eval"`
holds, and pipeline turns them into plain strings (`OmegaConf.to_container(..., enum_to_str=True)`).
Only the pipeline reads these classes; library objects take plain arguments. Sparsifier and compensation names and
task kinds are not Enums: they are whatever is registered (toptheta/registry.py), and `check` refuses an unknown name
with the list of known ones, and asks the registered sparsifier what it needs (a budget k or its own parameter, thresholds); `schema()`
adds each registered one's own settings to the sparsifier and comp groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from .evaluation.ruler import RulerSettings  # a plain dataclass (no heavy imports): task.ruler's schema
from .registry import active_compensations, compensation_kinds, sparsifier_kind, sparsifier_names, task_kind_names


class Choice(str, Enum):
    """Base of the choice Enums: prints as its value, so messages and paths read `post`, not `Placement.post`."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def _choices(name: str, *values: str) -> type[Choice]:
    return Choice(name, {value: value for value in values})


Dtype = _choices("Dtype", "float32", "float16", "bfloat16", "auto")
Placement = _choices("Placement", "pre", "post", "auto")
EmptyRows = _choices("EmptyRows", "keep-max", "reference")  # toptheta.sparsifiers.toptheta.EMPTY_ROWS
SdcEstimator = _choices("SdcEstimator", "exact", "exp-threshold", "calibrated")
Statistic = _choices("Statistic", "order", "target-k")
Granularity = _choices("Granularity", "layer", "layer-n", "layer-head", "layer-head-n")
Lookup = _choices("Lookup", "nearest", "linear")
Beyond = _choices("Beyond", "clamp", "fit")  # toptheta.thresholds.beyond.RULES
TargetMeasure = _choices("TargetMeasure", "attention", "vrows")  # what sparsifier.target_kept is a fraction of
CalibCompensation = _choices("CalibCompensation", "run", "reference", "none")
FewshotSampler = _choices("FewshotSampler", "default", "first_n")  # lm-eval's samplers
LoggerName = _choices("LoggerName", "none", "wandb")
WandbMode = _choices("WandbMode", "offline", "online", "disabled")

SIGMA_ADD_LIMIT = 3.0  # |calib.sigma_add| beyond this makes θ meaningless (check)

# Task fields only some kinds use: left out of a run's identity when null, so adding them to the schema did
# not change the id of runs stored before (their YAMLs never had these keys).
# task.vrow_popularity's keys besides `layer` (toptheta.attention.popularity; pipeline._popularity_recorder).
VROW_POPULARITY_DEFAULTS = {"group": 0, "max_steps": 256}

OPTIONAL_TASK_FIELDS = ("lm_eval_task", "include_path", "timeout_s", "lengths", "depths", "seed", "allow_unsafe_code",
                        "vrow_popularity", "decode_batch", "share_prefix", "filler", "fewshot_sampler",
                        "prompts_per_length", "ruler")


def _open_dict(key_type: type, element_type: type):
    """An empty typed mapping node without the struct flag: overrides may add keys (Hydra sets struct on the rest)."""
    return DictConfig({}, key_type=key_type, element_type=element_type, flags={"struct": False})


# Defaults below are placeholders: every option YAML sets its own values.
@dataclass
class ModelConfig:
    name: str = MISSING
    source: str = MISSING                 # packaged name, tiny-<arch>, local directory or hub id
    dtype: Dtype = Dtype["float32"]
    device: str = "cpu"                   # cpu, cuda, cuda:1, ...
    device_map: Optional[str] = None      # auto: spread over the visible GPUs (accelerate)
    revision: Optional[str] = None        # hub ids only
    max_length: Optional[int] = None      # tokens of context; null = the model's own limit
    chat_template: bool = False


@dataclass
class SparsifierConfig:
    name: str = MISSING                    # a registered sparsifier (toptheta/registry.py), checked by `check`
    placement: Optional[Placement] = None  # null only for dense
    k: Optional[int] = None                # null only for dense
    # layer -> k overrides, on a node without the struct flag: a command-line dict may name layers the YAML's default
    # does not (sparsifier.layer_k={0:512,1:512,2:512}; under Hydra's struct flag the new key 2 is refused). An
    # override merges into the YAML's entries (changes or adds layers); null clears them. Layers the model does not
    # have are refused once its depth is known (builders.check_sparsifies).
    layer_k: Optional[Dict[int, int]] = field(default_factory=lambda: _open_dict(int, int))
    empty_rows: Optional[EmptyRows] = None  # toptheta only: keep-max | reference (method.md §9, 10a)
    # Matched sparsity: the fraction of attention elements the run keeps, on the calibration rows; k is then
    # resolved per run (calibration/target_kept.py) and sparsifier.k is ignored. Part of the run id when set.
    target_kept: Optional[float] = None
    # What target_kept is a fraction of: null or attention (prefill attention elements, the QA tasks' measure), or
    # vrows (V rows read in decode steps, the generation tasks' measure: measured by decoding a few tokens after each
    # calibration row, or as the task decodes where it says how: HumanEval to the end of each answer). Part of the
    # run id when set.
    target_measure: Optional[TargetMeasure] = None
    # The task whose calibration rows target_kept is resolved on (its train split, or ours: python_code for
    # HumanEval); null: the generation task's own prompts where it builds them (ruler: another draw; HumanEval:
    # python_code functions in its prompt shape), else the calibration task (calib.task / task.calib_task). Set it
    # to fit on another task's rows (sparsifier.target_task=python_code). Part of the run id when set.
    target_task: Optional[str] = None
    # How close the fit must come to target_kept, relative (null: 0.05, calibration/target_kept.TOLERANCE). The
    # evaluated rows may keep another fraction than the rows the fit runs on (HumanEval's answers decode more rows
    # than its target prompts': −7 to −9 %): a tighter fit leaves the evaluation room inside the ±10 % a matched pair
    # allows. Part of the run id when set.
    target_tolerance: Optional[float] = None
    # The baselines' own parameters (null elsewhere, and then out of the run id): topp's probability mass p,
    # skipsoftmax's λ, toprho's share ρ of each row. With target_kept set, the parameter is fitted instead
    # (calibration/target_param.py).
    p: Optional[float] = None
    lam: Optional[float] = None
    rho: Optional[float] = None
    # toprho (and toptheta with budget=toprho): per layer, one weight per query head; head h of layer l keeps
    # min(1, ρ·w[l][h]) of each row (scripts/head_budget.py takes the weights from the shares another run's heads
    # kept). Null: every head keeps ρ.
    head_weights: Optional[List[List[float]]] = None
    # toptheta only: what θ is calibrated to approximate. null: each row's k largest scores (the paper); toprho:
    # Top-ρ's ⌈ρ·w·n⌉ largest (sparsifier.rho, or fitted by target_kept; head_weights as Top-ρ's), a budget that
    # grows with the row and differs between heads. It changes the calibration only (and its thresholds key).
    budget: Optional[str] = None


@dataclass
class CompConfig:
    sdc: Optional[SdcEstimator] = None
    sdc_scale: float = 1.0
    vmc: bool = False


COMP_FIELDS = tuple(f.name for f in fields(CompConfig))  # always in a run's comp (run ids); a newer one's only when set


@dataclass
class CalibConfig:
    statistic: Statistic = Statistic["order"]
    granularity: Granularity = Granularity["layer-head-n"]
    sigma_add: float = 0.1
    tac: bool = True
    compensation: CalibCompensation = CalibCompensation["run"]  # what calibration puts back (with tac)
    task: Optional[str] = None
    num_samples: Optional[int] = 120
    num_fewshot: Optional[int] = None
    sample_frac: float = 1.0
    seed: int = 0
    decode_tokens: int = 0
    lookup: Lookup = Lookup["nearest"]
    smooth_sigma: float = 0.0
    # Rows longer than any calibrated row: clamp (θ of the longest) or fit (a law of θ against n per layer and head,
    # thresholds/beyond.py). A run-time lookup option; clamp stays out of the run id.
    beyond: Beyond = Beyond["clamp"]
    # Rows as long as the evaluated ones: the calibration documents also calibrate at num_fewshot + cover_shots shots
    # (thresholds_cache.calibrate_on_task), so 25-shot questions longer than any 25-shot calibration document still
    # meet calibrated lengths. 0 (the default) stays out of the run id.
    cover_shots: int = 0
    # Tokens a calibration sequence is cut to (its last ones, as HFLM cuts a request). null: model.max_length, as the
    # evaluated lm-eval requests are. Long-context calibration (calib.task=long_documents for passkey, ruler, longbench)
    # needs it at least as long as the evaluated prompts: model.max_length (2048 for the small models) would cut the
    # documents there. null stays out of the run id.
    max_length: Optional[int] = None


@dataclass
class TaskConfig:
    name: str = MISSING
    kind: str = MISSING  # lm_eval, or a generation task registered in toptheta/registry.py (checked by `check`)
    lm_eval_task: Optional[str] = None     # lm_eval kind: our catalogue's name or any lm-eval task name
    include_path: Optional[str] = None     # lm_eval kind: a folder of the user's own task YAMLs
    calib_task: Optional[str] = None
    num_fewshot: Optional[int] = None
    # lm_eval tasks: lm-eval's few-shot sampler. null = `default` (a random draw per question, the paper's protocol);
    # first_n: the first num_fewshot documents of the few-shot split for every question (fixed exemplars, so every
    # context shares them and the prefix cache runs them once). Part of the run id when set.
    fewshot_sampler: Optional[FewshotSampler] = None
    # Multiple-choice scoring: run the token prefix that contexts share once (evaluation/prefix_cache.py). Not part of
    # the run id: same log-likelihoods and statistics (tests/test_prefix_cache.py); false turns it off.
    prefix_cache: bool = True
    limit: Any = None                      # documents: int >= 1, a fraction in (0, 1), or null for all
    batch_size: Any = 1                    # int >= 1 or "auto"
    metric: Optional[str] = None
    max_length: Optional[int] = None
    timeout_s: Optional[float] = None      # humaneval
    lengths: Optional[List[int]] = None    # passkey, ruler
    depths: Optional[List[float]] = None   # passkey
    seed: Optional[int] = None             # passkey, ruler
    prompts_per_length: Optional[int] = None  # ruler: prompts per length, dealt to its sub-tasks in turn
    ruler: Optional[RulerSettings] = None  # ruler: sub-tasks and difficulty knobs (evaluation/ruler.py)
    allow_unsafe_code: Optional[bool] = None  # humaneval: run completions without the sandbox
    # Generation tasks: prompts decoded together (null = 1: one model.generate per prompt, the reference); lm_eval
    # tasks: generate_until requests decoded together (null = 1; batch_size batches multiple-choice scoring only).
    # Part of the run id, unlike batch_size: a batch's GEMMs round differently, so a near-tie greedy token can differ.
    decode_batch: Optional[int] = None
    # Generation tasks: run the leading tokens prompts share once (evaluation/prefix_sharing.py; passkey prompts with
    # filler: shared). Part of the run id like decode_batch (Top-k's plain kernel rounds per forward).
    share_prefix: Optional[bool] = None
    filler: Optional[str] = None           # passkey: independent (null) or shared (evaluation/passkey.py)
    # Generation tasks: {layer: L, group: 0, max_steps: 256}: per decode step of the first generation, how many
    # query heads of each KV group keep each V row of layer L (toptheta.attention.popularity), stored in the run's
    # stats.json. Typed Any (checked in `check`): OmegaConf cannot merge an override into a None dataclass field.
    vrow_popularity: Any = None


@dataclass
class LoggerConfig:
    name: LoggerName = MISSING
    project: Optional[str] = None
    entity: Optional[str] = None
    mode: Optional[WandbMode] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = MISSING
    sparsifier: SparsifierConfig = MISSING
    comp: CompConfig = MISSING
    calib: CalibConfig = MISSING
    task: TaskConfig = MISSING
    logger: LoggerConfig = MISSING
    data_dir: Optional[str] = "auto"       # auto | hub | a folder (see README, Offline data)
    results_dir: str = "outputs/results"
    baseline: bool = True
    force: bool = False
    seed: int = 1234
    chunk_size: Optional[int] = None
    log_samples: bool = True


def register() -> None:
    """Make `config_schema` (conf/config.yaml's first default) known to Hydra; idempotent. Call it after registering
    a sparsifier or compensation of your own: the schema then has its settings (see `schema`)."""
    from hydra.core.config_store import ConfigStore  # hydra: only to compose; the library modules import without it

    ConfigStore.instance().store(name="config_schema", node=schema())


def schema() -> type:
    """`Config`, its sparsifier and comp groups grown by the settings of every registered sparsifier and compensation
    that the classes above do not name (e.g. `window` of a sliding-window sparsifier, `comp.halfsdc`), typed Any and
    null by default: so a new one's YAML composes and a typo in a key still fails. Null settings stay out of run ids
    (pipeline.plan), so stored runs keep theirs."""
    def grown(base: type, keys: list[str]) -> type:
        new = [key for key in dict.fromkeys(keys) if key not in {f.name for f in fields(base)}]
        return make_dataclass(base.__name__, [(key, Optional[Any], None) for key in new], bases=(base,)) if new else base

    sparsifier = grown(SparsifierConfig, [key for name in sparsifier_names() for key in sparsifier_kind(name).keys])
    comp = grown(CompConfig, [key for kind in compensation_kinds() for key in (kind.name, *kind.keys)])
    if sparsifier is SparsifierConfig and comp is CompConfig:
        return Config
    return make_dataclass("Config", [("sparsifier", sparsifier, MISSING), ("comp", comp, MISSING)], bases=(Config,))


# ---- ranges: what types cannot say --------------------------------------------------------------------------

def is_int(value: Any, minimum: int) -> bool:
    """An int (not a bool) of at least `minimum`: the range check every entry point applies to counts and sizes."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check(cfg: Any) -> None:
    """Raise ValueError listing every out-of-range value of a composed config (a DictConfig or plain dict)."""
    def get(node: Any, key: str) -> Any:
        return node.get(key)

    model, sparsifier, comp, calib, task = (get(cfg, g) for g in ("model", "sparsifier", "comp", "calib", "task"))
    problems = []

    def need(ok: bool, key: str, value: Any, valid: str) -> None:
        if not ok:
            problems.append(f"{key}={value!r}: {valid}")

    problems.extend(sparsifier_problems(sparsifier, comp))
    need(get(comp, "sdc_scale") > 0, "comp.sdc_scale", get(comp, "sdc_scale"), "a positive factor (1.0 = none)")
    for key, minimum in (("num_samples", 1), ("num_fewshot", 0), ("cover_shots", 0), ("max_length", 2)):
        value = get(calib, key)
        need(value is None or is_int(value, minimum), f"calib.{key}", value, f"null or an integer >= {minimum}")
    # θ = mean + sigma_add · std of each row's (k+1)-th largest score: beyond ±3 std it lies outside nearly every
    # calibration row's score, so rows keep everything (below) or only their maximum (above).
    need(-SIGMA_ADD_LIMIT <= get(calib, "sigma_add") <= SIGMA_ADD_LIMIT, "calib.sigma_add", get(calib, "sigma_add"),
         f"a number of standard deviations in [-{SIGMA_ADD_LIMIT:g}, {SIGMA_ADD_LIMIT:g}] (the paper: 0.1; "
         "θ beyond them keeps every key or only each row's maximum)")
    need(0 < get(calib, "sample_frac") <= 1, "calib.sample_frac", get(calib, "sample_frac"), "a fraction in (0, 1]")
    need(is_int(get(calib, "decode_tokens"), 0), "calib.decode_tokens", get(calib, "decode_tokens"), "an integer >= 0")
    need(get(calib, "smooth_sigma") >= 0, "calib.smooth_sigma", get(calib, "smooth_sigma"), "a width >= 0 (0 = off)")
    _check_task(task, get, need)
    for key, node, minimum in (("model.max_length", model, 2), ("chunk_size", cfg, 1)):
        value = get(node, key.split(".")[-1])
        need(value is None or is_int(value, minimum), key, value, f"null or an integer >= {minimum}")
    if problems:
        raise ValueError("invalid configuration:\n  " + "\n  ".join(problems))


def sparsifier_problems(sparsifier: Any, comp: Any, fits_target: bool = True) -> list[str]:
    """What is wrong with a run's sparsifier and comp settings (a DictConfig or plain dict each), asked of the registry:
    the name, what the named rule needs (a budget k or its own parameter), its placements, and no setting that only
    another rule or no registered compensation reads. ``toptheta-eval`` checks its model_args with this too (it has no
    sparsifier.target_kept: ``fits_target=False`` leaves that fix out of the messages)."""
    def get(node: Any, key: str) -> Any:
        return node.get(key)

    problems: list[str] = []

    def need(ok: bool, key: str, value: Any, valid: str) -> None:
        if not ok:
            problems.append(f"{key}={value!r}: {valid}")

    name = str(get(sparsifier, "name"))
    if name not in sparsifier_names():
        return [f"sparsifier.name={name!r}: one of {', '.join(sparsifier_names())} (or a sparsifier registered with "
                "toptheta.registry.register_sparsifier)"]
    kind = sparsifier_kind(name)
    k, target = get(sparsifier, "k"), get(sparsifier, "target_kept")
    need(target is None or (isinstance(target, (int, float)) and not isinstance(target, bool) and 0 < target < 1),
         "sparsifier.target_kept", target, "null (k decides) or a fraction in (0, 1), e.g. sparsifier.target_kept=0.1")
    need(target is None or kind.drops, "sparsifier.target_kept", target, f"null for {name} (it keeps everything)")
    measure = get(sparsifier, "target_measure")
    need(measure is None or target is not None, "sparsifier.target_measure", measure,
         "null without sparsifier.target_kept (it says what the target is a fraction of)")
    rows = get(sparsifier, "target_task")
    need(rows is None or target is not None, "sparsifier.target_task", rows,
         "null without sparsifier.target_kept (it names the rows the target is resolved on)")
    tolerance = get(sparsifier, "target_tolerance")
    need(tolerance is None or (target is not None and isinstance(tolerance, (int, float))
                               and not isinstance(tolerance, bool) and 0 < tolerance < 0.5),
         "sparsifier.target_tolerance", tolerance,
         "null (0.05), or a relative tolerance in (0, 0.5) with sparsifier.target_kept, e.g. 0.02")
    if kind.parameter is not None:
        _check_parameter(kind, sparsifier, comp, get, need, fits_target)
    elif kind.drops and target is None:
        need(is_int(k, 1), "sparsifier.k", k, "give a positive integer, e.g. sparsifier.k=64")
    placement = get(sparsifier, "placement")
    if kind.drops:
        need(placement is not None and str(placement) in (*kind.placements, "auto"), "sparsifier.placement", placement,
             f"use {', '.join(kind.placements)} or auto")
    for other in map(sparsifier_kind, sparsifier_names()):  # another rule's setting would silently mean nothing
        for key in other.keys:
            if key not in kind.keys:
                need(get(sparsifier, key) is None, f"sparsifier.{key}", get(sparsifier, key),
                     f"null: only sparsifier={other.name} reads it")
    try:  # its own options' values (Top-ρ's head_weights), as the rule itself checks them, with the target beside
        kind.check_options({**{key: get(sparsifier, key) for key in kind.options}, "target_kept": target})
    except ValueError as err:
        problems.append(str(err))
    layer_ks = get(sparsifier, "layer_k")
    need(layer_ks is None or hasattr(layer_ks, "items"), "sparsifier.layer_k", layer_ks,
         "a mapping of layer index to k, e.g. sparsifier.layer_k={0:512,1:512}, or null for none")
    for layer, layer_k in (dict(layer_ks) if hasattr(layer_ks, "items") else {}).items():
        need(is_int(layer, 0) and is_int(layer_k, 1), "sparsifier.layer_k", {layer: layer_k},
             "map a layer index >= 0 to a k >= 1, e.g. sparsifier.layer_k={0:512,1:512}")
    known = {f.name for f in fields(CompConfig)} | {key for c in compensation_kinds() for key in (c.name, *c.keys)}
    for key in comp.keys():  # a key added with +comp.<name>=... that no registered compensation reads: a typo
        need(key in known, f"comp.{key}", get(comp, key), f"a registered compensation: {', '.join(sorted(known))}")
    return problems


def _check_parameter(kind, sparsifier: Any, comp: Any, get, need, fits_target: bool) -> None:
    """A rule with its own parameter (top-p's p, skip-softmax's λ): the parameter (unless target_kept fits it), an
    optional k, and no compensation that needs thresholds (they are calibrated at a budget k, which it has not)."""
    key, k, target = kind.parameter.key, get(sparsifier, "k"), get(sparsifier, "target_kept")
    value = get(sparsifier, key)
    need(target is not None or kind.parameter.accepts(value), f"sparsifier.{key}", value,
         kind.parameter.valid + (" (or sparsifier.target_kept=0.1 to fit it)" if fits_target else ""))
    need(k is None or is_int(k, 1), "sparsifier.k", k, "null (every row sparsified) or an integer >= 1 (rows with at "
         "most k keys kept whole)")
    plain = dict(comp.items())
    for comp_kind in active_compensations(plain):
        need(not comp_kind.needs_thresholds(plain), f"comp.{comp_kind.name}", get(comp, comp_kind.name),
             f"{comp_kind.without_thresholds} for sparsifier={kind.name} (this setting needs thresholds, calibrated at "
             "a budget k, which the rule has not)")


def _check_task(task: Any, get, need) -> None:
    kinds = task_kind_names()
    need(str(get(task, "kind")) in kinds, "task.kind", get(task, "kind"),
         f"one of {', '.join(kinds)} (a generation task registers with toptheta.registry.register_task_kind)")
    num_fewshot, limit, batch_size = get(task, "num_fewshot"), get(task, "limit"), get(task, "batch_size")
    need(num_fewshot is None or is_int(num_fewshot, 0), "task.num_fewshot", num_fewshot,
         "null (the task's default) or an integer >= 0")
    need(limit is None or is_int(limit, 1) or (isinstance(limit, float) and 0 < limit < 1), "task.limit", limit,
         "null (all documents), an integer >= 1 (a count) or a float in (0, 1) (a fraction)")
    need(is_int(batch_size, 1) or batch_size == "auto", "task.batch_size", batch_size, "an integer >= 1 or auto")
    need(get(task, "max_length") is None or is_int(get(task, "max_length"), 2), "task.max_length",
         get(task, "max_length"), "null (the model's limit) or an integer >= 2")
    if str(get(task, "kind")) == "lm_eval":
        need(bool(get(task, "lm_eval_task")), "task.lm_eval_task", get(task, "lm_eval_task"),
             "an lm-eval task name, e.g. task=lm_eval task.lm_eval_task=piqa")
    elif get(task, "include_path") is not None:
        need(False, "task.include_path", get(task, "include_path"), f"only lm_eval tasks read task YAMLs, not {get(task, 'kind')}")
    decode_batch = get(task, "decode_batch")
    if str(get(task, "kind")) == "lm_eval":
        need(decode_batch is None or is_int(decode_batch, 1), "task.decode_batch", decode_batch,
             "null (one generation request at a time) or an integer >= 1")
    else:
        need(batch_size == 1, "task.batch_size", batch_size,
             f"1 for {get(task, 'kind')} (to decode prompts together, set task.decode_batch=16)")
        need(decode_batch is None or is_int(decode_batch, 1), "task.decode_batch", decode_batch,
             "null (one prompt at a time) or an integer >= 1")
        need(decode_batch in (None, 1) or get(task, "vrow_popularity") is None, "task.decode_batch", decode_batch,
             "null with task.vrow_popularity (it records one generation of batch 1)")
        need(decode_batch in (None, 1) or not get(task, "share_prefix"), "task.decode_batch", decode_batch,
             "null with task.share_prefix=true (shared prefixes continue one prompt at a time)")
    need(get(task, "share_prefix") in (None, False) or str(get(task, "kind")) != "lm_eval", "task.share_prefix",
         get(task, "share_prefix"), "null for lm_eval tasks (multiple-choice contexts are shared by task.batch_size)")
    sampler = get(task, "fewshot_sampler")
    need(sampler in (None, "default") or str(get(task, "kind")) == "lm_eval", "task.fewshot_sampler", sampler,
         "null for generation tasks (they have no few-shot exemplars)")
    filler = get(task, "filler")
    need(filler is None or (str(get(task, "kind")) == "passkey" and filler in ("independent", "shared")),
         "task.filler", filler, "null, independent or shared, for passkey tasks only")
    _check_ruler(task, get, need)
    popularity = get(task, "vrow_popularity")
    if popularity is not None:
        need(str(get(task, "kind")) != "lm_eval", "task.vrow_popularity", "{...}",
             "only generation tasks (humaneval, passkey) have decode steps to record")
        unknown = sorted(set(popularity) - {"layer", "group", "max_steps"}) if hasattr(popularity, "keys") else ["?"]
        need(not unknown, "task.vrow_popularity", unknown, "a mapping with keys layer, group (default 0), max_steps "
             "(default 256, null = all), e.g. task.vrow_popularity={layer:12}")
        popularity = {**VROW_POPULARITY_DEFAULTS, **(dict(popularity) if not unknown else {})}
        for key, minimum in (("layer", 0), ("group", 0), ("max_steps", 1)):
            value = popularity.get(key)
            need((key == "max_steps" and value is None) or is_int(value, minimum), f"task.vrow_popularity.{key}", value,
                 f"an integer >= {minimum}" + (" or null" if key == "max_steps" else ""))


def _check_ruler(task: Any, get, need) -> None:
    """task.prompts_per_length and task.ruler: set for ruler tasks (their ranges: RulerSettings), null for others."""
    if str(get(task, "kind")) != "ruler":
        for key in ("prompts_per_length", "ruler"):
            need(get(task, key) is None, f"task.{key}", "{...}" if key == "ruler" else get(task, key),
                 "null for tasks other than ruler")
        return
    per_length = get(task, "prompts_per_length")
    need(is_int(per_length, 1), "task.prompts_per_length", per_length, "an integer >= 1, e.g. 50")
    settings = dict(get(task, "ruler") or {})
    if "subtasks" in settings:
        settings["subtasks"] = list(settings["subtasks"])
    for key, value, valid in RulerSettings(**settings).problems():
        need(False, key, value, valid)


def defaults(schema) -> dict:
    """A config group's defaults as plain values (choices as their strings), as ``run.py`` composes them."""
    return OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)
