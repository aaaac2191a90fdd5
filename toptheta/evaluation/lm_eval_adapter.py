"""Run lm-eval on an already-loaded (possibly sparsified) transformers model, and get the token
sequences a task's calibration split would feed it.

Tasks come from toptheta.evaluation.tasks (stock lm-eval tasks with a local or hub data source,
their `_calibration` variants, and `smoke`). The data source is resolved once per call by
tasks.resolve_data_dir: a directory, `"auto"` ($TOPTHETA_DATA_DIR, else the copy shipped in
toptheta/data), or None / `"hub"` (the Hugging Face hub).
All argument, task-name and data-file checks run before lm-eval builds anything and before the
model is touched, so a typo fails in milliseconds rather than after model loading.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toptheta.config import is_int
from toptheta.evaluation.longbench import NO_CHAT_TEMPLATE
from toptheta.evaluation.tasks import (
    DATA_DIR_ENV,
    base_name,
    calibration_name,
    check_tasks,
    fewshot_source,
    is_longbench,
    resolve_data_dir,
    task_names,
    task_include_paths,
    task_spec,
)

if TYPE_CHECKING:
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def _check_run_args(num_fewshot: Any, limit: Any, batch_size: Any, max_length: Any) -> None:
    """Argument checks shared by evaluate_tasks and calibration_requests."""
    if num_fewshot is not None and not is_int(num_fewshot, 0):
        raise ValueError(f"num_fewshot must be None (task default) or an int >= 0, got {num_fewshot!r}")
    if limit is not None:
        # lm-eval reads a float < 1 as a fraction of the docs but int(limit) otherwise, so 1.0
        # would silently mean "1 document": accept only unambiguous values.
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise ValueError(f"limit must be None, an int >= 1 or a float in (0, 1), got {limit!r}")
        if isinstance(limit, int) and limit < 1:
            raise ValueError(f"limit must be >= 1 documents, got {limit}; use None for all documents")
        if isinstance(limit, float) and not 0.0 < limit < 1.0:
            raise ValueError(
                f"a float limit is a fraction of the documents and must be in (0, 1), got {limit}; "
                f"use an int for a document count"
            )
    if not (is_int(batch_size, 1) or batch_size == "auto"):
        raise ValueError(f"batch_size must be an int >= 1 or 'auto', got {batch_size!r}")
    if max_length is not None and not is_int(max_length, 2):
        raise ValueError(f"max_length must be None (model default) or an int >= 2, got {max_length!r}")


def _task_manager(include_paths: list[str], stock: bool = False) -> TaskManager:
    """A TaskManager that indexes our task dirs (and lm-eval's own tasks only if `stock`).

    Indexing lm-eval's ~15k stock YAMLs costs ~20 s per call, and our YAMLs reach the stock ones
    through absolute `include:` paths anyway, so it happens only for tasks outside our catalogue.
    """
    from lm_eval.tasks import TaskManager

    _compile_templates_once()
    return TaskManager(include_path=include_paths, include_defaults=stock)


def _compile_templates_once() -> None:
    """Make lm-eval compile each prompt template once instead of once per use (the same text, ~10× faster prompts).

    lm-eval 0.4.13 renders ``doc_to_text``/``doc_to_target``/``doc_to_choice`` through ``utils.apply_template``, which
    compiles its Jinja template from the string on every call: a 25-shot question renders ~80 templates, and building
    ARC-Easy's 2,376 25-shot contexts took 5 minutes here, 90 % of it in Jinja's compiler. The compiled templates
    are kept per template text in the same environment, so every rendering is what lm-eval's own would be.
    """
    import functools

    from lm_eval import utils

    if getattr(utils.apply_template, "_toptheta_cached", False):
        return
    compile_template = functools.lru_cache(maxsize=4096)(utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compile_template(template).render(**doc)

    apply_template._toptheta_cached = True  # type: ignore[attr-defined]
    apply_template.compiled = compile_template  # type: ignore[attr-defined]  (its cache_info() counts the reuse)
    apply_template.stock = utils.apply_template  # type: ignore[attr-defined]
    utils.apply_template = apply_template


def is_catalogued(task: str) -> bool:
    """Whether `task` is one of ours (an offline variant, a calibration variant, smoke)."""
    return isinstance(task, str) and task in task_names()


def _user_paths(include_path: str | os.PathLike[str] | None) -> list[str]:
    if include_path is None:
        return []
    path = Path(include_path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"task include_path {path} does not exist; point it at a folder of lm-eval task YAMLs")
    return [str(path)]


def _needs_stock(external: list[str], user_paths: list[str]) -> bool:
    """Whether the external tasks need lm-eval's own index (not all of them are in the user's YAMLs)."""
    return bool(external) and not set(external) <= set(_task_manager(user_paths).all_tasks if user_paths else [])


def check_external_tasks(tasks: list[str], include_path: str | os.PathLike[str] | None = None) -> list[str]:
    """Check that `tasks` (names outside our catalogue) are lm-eval tasks; return the include paths to use.

    Looks in `include_path` first, then lm-eval's own tasks (indexing those takes ~20 s, still before any
    model work). Unknown names raise ValueError with the closest known names.
    """
    import difflib

    paths = _user_paths(include_path)
    known = set(_task_manager(paths, stock=_needs_stock(tasks, paths)).all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        close = sorted({m for t in unknown for m in difflib.get_close_matches(t, known, n=5)})
        raise ValueError(
            f"unknown lm-eval task(s) {unknown}: neither ours ({', '.join(task_names())}) nor lm-eval's"
            f"{' nor under ' + paths[0] if paths else ''}. Close names: {', '.join(close) or 'none'}. "
            f"`lm_eval ls tasks` lists lm-eval's tasks; task.include_path=<folder> adds your own YAMLs."
        )
    return paths


def clip_samples(samples: dict[str, list[dict]], max_chars: int = 2000) -> dict[str, list[dict]]:
    """lm-eval's per-sample logs with every string longer than `max_chars` clipped (head and tail kept).

    Few-shot prompts and LongBench contexts repeat kilobytes per choice; clipped, a run's samples.json
    stays a few MB while keeping each document's id, target, responses, metrics and hashes.
    """
    def clip(value: Any) -> Any:
        if isinstance(value, str) and len(value) > max_chars:
            half = max_chars // 2
            return f"{value[:half]} [... {len(value) - max_chars} characters clipped ...] {value[-half:]}"
        if isinstance(value, dict):
            return {key: clip(v) for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clip(v) for v in value]
        return value

    return {task: [clip(sample) for sample in rows] for task, rows in samples.items()}


FEWSHOT_SAMPLERS = ("default", "first_n")  # lm-eval's samplers this project offers (lm_eval.api.samplers)


def _check_sampler(sampler: str | None) -> None:
    if sampler is not None and sampler not in FEWSHOT_SAMPLERS:
        raise ValueError(f"fewshot_sampler={sampler!r}: use None (the task's own), "
                         f"{' or '.join(FEWSHOT_SAMPLERS)} (first_n: the same exemplars for every question)")


def _load_tasks(manager: TaskManager, tasks: list[str], data_dir: Path | None,
                fewshot_sampler: str | None = None) -> dict[str, Task]:
    """Build the lm-eval Task objects (this loads the datasets), with a hint on hub failures, each with the
    few-shot sampler ``fewshot_sampler`` when one is given (None or ``default``: the task's own)."""
    try:
        loaded = manager.load(tasks)["tasks"]
    except Exception as err:
        if data_dir is not None or all(is_catalogued(t) and not task_spec(base_name(t)).needs_data for t in tasks):
            raise
        raise RuntimeError(
            f"loading {tasks} from the Hugging Face hub failed ({type(err).__name__}: {err}). "
            f"Offline, use data_dir='auto' (the copy shipped with toptheta, or ${DATA_DIR_ENV}) or a data dir."
        ) from err
    if fewshot_sampler not in (None, "default"):
        for task in loaded.values():
            _replace_sampler(task, fewshot_sampler)
    return loaded


def _replace_sampler(task: Task, name: str) -> None:
    """Give a built lm-eval task another few-shot sampler, as its YAML's ``fewshot_config.sampler: <name>`` would.

    lm-eval builds the sampler in ``ConfigurableTask.__init__`` from the task's few-shot documents, and a dict
    override of ``fewshot_config`` at load time replaces the whole task config (lm-eval 0.4.13), so the sampler
    is swapped here, the one place that touches it.
    """
    from lm_eval.api import samplers

    docs = task.fewshot_docs()
    if docs is None or not hasattr(task, "sampler"):
        return  # a task without few-shot documents: nothing to draw
    task.sampler = samplers.get_sampler(name)(list(docs), rnd=None)


def _data_sources(tasks: list[str], data_dir: Path | None) -> dict[str, str]:
    """Where each task's documents came from, for the results record."""
    out = {}
    for task in tasks:
        if not is_catalogued(task):
            out[task] = "lm-eval task (its own data source, usually the Hugging Face hub)"
            continue
        spec = task_spec(base_name(task))
        if not spec.needs_data:
            out[task] = spec.own_source
        elif data_dir is None:
            out[task] = "huggingface hub"
        else:
            out[task] = str(data_dir)
    return out


def _use_chat_template(tasks: list[str], tokenizer: PreTrainedTokenizerBase, chat_template: bool) -> bool:
    """Whether lm-eval wraps the prompts in the chat template (it does so for a whole call).

    LongBench's convention: chat models get their template, except on the few-shot and code
    subsets (longbench.NO_CHAT_TEMPLATE, and their LongBench-E `_e` variants), which get raw text.
    """
    if not chat_template:
        return False
    raw = [t for t in tasks if is_longbench(t) and t.removeprefix("longbench_").removesuffix("_e") in NO_CHAT_TEMPLATE]
    if raw and len(raw) < len(tasks):
        raise ValueError(
            f"{raw} take raw prompts even for chat models (LongBench's convention) but the other "
            f"tasks take the chat template; evaluate them in separate calls"
        )
    if raw:
        log.info("%s: LongBench feeds these raw prompts, chat_template ignored", raw)
        return False
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template=True but the tokenizer has no chat template; pass chat_template=False")
    return True


def evaluate_tasks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    *,
    data_dir: str | os.PathLike[str] | None,
    num_fewshot: int | None,
    limit: int | float | None,
    batch_size: int | str = 1,
    max_length: int | None = None,
    scoring: str = "shared",
    log_samples: bool = False,
    seed: int = 1234,
    bootstrap_iters: int = 100_000,
    chat_template: bool = False,
    gen_kwargs: dict[str, Any] | None = None,
    include_path: str | os.PathLike[str] | None = None,
    decode_batch: int | None = None,
    fewshot_sampler: str | None = None,
    prefix_cache: bool = True,
) -> dict[str, Any]:
    """Evaluate `model` on `tasks` with lm-eval and return lm-eval's results dict.

    A task of our catalogue (task_names()) runs our offline variant; any other name is an lm-eval
    task, looked up in `include_path` (a folder of the user's task YAMLs) and lm-eval's own tasks, with
    its own data source (usually the hub). `log_samples` keeps per-sample outputs under `samples`
    (clip_samples shortens them for storage).

    The model is used as given (no copy, no device move, whatever attention implementation it
    has), wrapped in lm-eval's HFLM. `num_fewshot=None` keeps each task's default (0 for ours);
    `limit` is a document count (int) or fraction (float < 1) per task; `max_length=None` lets
    HFLM take the model's context length (see hflm_max_length). `seed` seeds Python, NumPy,
    torch and the few-shot sampler. `bootstrap_iters` only matters for non-mean metrics.
    `chat_template=True` wraps each prompt in the tokenizer's chat template (lm-eval's
    apply_chat_template; LongBench's few-shot and code subsets stay raw, see _use_chat_template).
    `gen_kwargs` updates generation tasks' generation_kwargs (e.g. {"max_gen_toks": 16}).

    `scoring` picks the lm-eval model class for loglikelihood (multiple-choice) requests, all giving
    the same log-likelihoods and sparsity statistics: "shared" (SharedContextHFLM: each distinct
    context runs once, its choices are scored from the cached keys/values), "batched" (BatchedHFLM:
    left-padded batches with an attention mask) or "stock" (lm-eval's HFLM; with batch_size > 1 its
    right-padded rows would count in the statistics). `batch_size` ("auto": the largest batch within
    a token budget on CPU) is contexts per forward for "shared", sequences per forward otherwise.
    `decode_batch` is the number of generation (generate_until) requests decoded together (None:
    `batch_size`); greedy batches decode through batched_generation (not with "stock" scoring).
    `fewshot_sampler` replaces each task's few-shot sampler (lm-eval's ``fewshot_config.sampler``: ``first_n``
    gives every question the same exemplars; None or ``default`` keeps the task's own). `prefix_cache` (shared
    scoring) runs the token prefix that contexts share once (``prefix_cache.py``: same numbers).
    LongBench tasks run through MiddleTruncatingHFLM: a prompt longer than max_length minus the
    generation budget keeps its head and tail (LongBench's rule) instead of HFLM's tail only.

    The returned dict is lm-eval's (`results`, `configs`, `n-shot`, `n-samples`, `config`, ...
    plus `samples` when log_samples) with one extra key, `toptheta`: the resolved data dir,
    each task's data source, and `fewshot_deviations` (task -> where its few-shot examples came
    from, for offline tasks without a train split; empty otherwise).
    """
    _check_run_args(num_fewshot, limit, batch_size, max_length)
    _check_sampler(fewshot_sampler)
    if scoring not in SCORING:
        raise ValueError(f"scoring must be one of {sorted(SCORING)}, got {scoring!r}")
    if decode_batch is not None and (not is_int(decode_batch, 1) or scoring == "stock"):
        raise ValueError(f"decode_batch must be None or an int >= 1 with scoring 'shared' or 'batched', got "
                         f"decode_batch={decode_batch!r} with scoring={scoring!r}")
    resolved = resolve_data_dir(data_dir)
    tasks = list(tasks) if isinstance(tasks, tuple) else tasks
    if not isinstance(tasks, list) or not tasks:
        check_tasks(tasks, resolved, num_fewshot)  # raises, naming the problem
    ours = [t for t in tasks if is_catalogued(t)]
    if ours:
        check_tasks(ours, resolved, num_fewshot)
    external = [t for t in tasks if t not in ours]
    user_paths = check_external_tasks(external, include_path) if external else []
    use_chat = _use_chat_template(tasks, tokenizer, chat_template)
    deviations = {t: s for t in ours if (s := fewshot_source(t, resolved, num_fewshot))}
    for task, source in deviations.items():
        log.warning("%s: %d-shot examples come from %s, not train as in stock lm-eval", task, num_fewshot, source)

    from lm_eval import simple_evaluate

    from toptheta.evaluation.longbench_lm import MiddleTruncatingHFLM

    with task_include_paths(ours, resolved) as include_paths:
        manager = _task_manager(include_paths + user_paths, stock=_needs_stock(external, user_paths))
        # Datasets load here, still before the model is wrapped: data errors surface first.
        loaded = _load_tasks(manager, tasks, resolved, fewshot_sampler)
        lm_class = MiddleTruncatingHFLM if any(is_longbench(t) for t in tasks) else _lm_class(scoring)
        batching = {} if decode_batch is None else {"decode_batch": decode_batch}  # HFLM has no decode_batch
        if lm_class is _lm_class("shared"):
            batching["prefix_cache"] = prefix_cache
        lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, **batching)
        results = simple_evaluate(
            model=lm,
            tasks=list(loaded.values()),
            num_fewshot=num_fewshot,
            limit=limit,
            log_samples=log_samples,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            apply_chat_template=use_chat,
            gen_kwargs=gen_kwargs,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    if results is None:  # only non-zero ranks get None; we never run distributed
        raise RuntimeError("lm-eval returned no results (not rank 0?)")
    results["toptheta"] = {
        "data_dir": None if resolved is None else str(resolved),
        "data_sources": _data_sources(tasks, resolved),
        "fewshot_deviations": deviations,
    }
    return results


SCORING = ("shared", "batched", "stock")


def _lm_class(scoring: str) -> type:
    """The lm-eval model class of a `scoring` option (see evaluate_tasks)."""
    from lm_eval.models.huggingface import HFLM

    from toptheta.evaluation.shared_context_lm import BatchedHFLM, SharedContextHFLM

    return {"shared": SharedContextHFLM, "batched": BatchedHFLM, "stock": HFLM}[scoring]


def hflm_max_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    """The context length HFLM uses for `model` when max_length is None (lm-eval's own rule)."""
    from lm_eval.models.utils import resolve_max_length

    return resolve_max_length(model.config, tokenizer)


def encode_request(
    tokenizer: PreTrainedTokenizerBase, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """Token ids of one loglikelihood request, split as HFLM splits them (causal models).

    Mirrors lm-eval 0.4.x `LM.loglikelihood` + `TemplateLM._encode_pair` + `HFLM.tok_encode`
    with HFLM's defaults (add_bos_token=None, no custom prefix token):
    - trailing spaces of the context move to the continuation;
    - the whole string and the context are encoded with the tokenizer's default special tokens
      (unless the text already starts with the BOS string), and the continuation ids are the
      whole encoding minus the context's length;
    - an empty context becomes the BOS token (EOS if there is no BOS).
    tests/test_tasks.py checks this against a real HFLM.
    """
    prefix_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if context == "":
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        return ([prefix_id], cont) if prefix_id != cont[0] else (cont[:1], cont[1:])

    bos_text = tokenizer.decode(prefix_id)

    def encode(text: str) -> list[int]:
        if text.startswith(bos_text):
            return tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.encode(text)

    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids) :]


def calibration_requests(
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    *,
    data_dir: str | os.PathLike[str] | None,
    num_fewshot: int | None,
    limit: int | float | None,
    max_length: int | None,
    seed: int = 1234,
    fewshot_sampler: str | None = None,
    draw: int = 0,
    reserve: int = 0,
) -> list[list[int]]:
    """The token id sequences HFLM would feed the model for `task`'s calibration (train) split.

    `task` is a base name (`arc_challenge`) or its calibration name (`arc_challenge_calibration`).
    The task is built through lm-eval (same prompts, few-shot sampling with `seed`, `limit`
    semantics), and each loglikelihood request becomes the model input HFLM builds for it:
    ``(context_ids + continuation_ids)[-(max_length + 1):][:-1]``; the last token is dropped
    because its logits are never needed. `max_length=None` means no truncation; pass
    hflm_max_length(model, tokenizer) to match an evaluation run exactly.

    Order: document order, then each document's requests (choices) in order. lm-eval's own
    execution order (its Collator sorts by descending length and batches) is NOT used: it is an
    efficiency detail, and document order is deterministic and independent of batch size.
    Identical inputs are kept once (first occurrence): with logits_cache (on by default) HFLM
    runs one forward pass for requests whose inputs coincide, e.g. single-token choices.

    With `fewshot_sampler="first_n"` every document gets the first `num_fewshot` train documents as its
    exemplars, as the evaluated questions do (their few-shot split is train): those documents are then left out
    of the calibration documents, which are the `limit` documents after them.

    `draw` d > 0 takes the d-th block of `limit` documents after those instead (documents d·limit to
    (d + 1)·limit − 1 of the remaining ones): calibration draws that share no document (``calib.seed``), so the
    variance of a calibration can be measured. It needs an integer `limit`, and a split long enough.

    `reserve` more leading documents are left out of the calibration documents with first_n (the exemplars of a
    calibration at more shots, ``calib.cover_shots``), so both calibrate the same documents.
    """
    _check_run_args(num_fewshot, limit, 1, max_length)
    _check_sampler(fewshot_sampler)
    skip = (num_fewshot or 0) + reserve if fewshot_sampler == "first_n" else 0
    if draw:
        if not isinstance(limit, int) or limit < 1 or draw < 0:
            raise ValueError(f"calibration draw {draw} needs a whole number of calibration documents (calib.num_samples"
                             f"=64, say) and a draw >= 0; got num_samples={limit!r}")
        skip += draw * limit
    resolved = resolve_data_dir(data_dir)
    calib = calibration_name(task) if isinstance(task, str) else task
    check_tasks([calib], resolved, num_fewshot)

    with task_include_paths([calib], resolved) as include_paths:
        lm_task = _load_tasks(_task_manager(include_paths), [calib], resolved, fewshot_sampler)[calib]
        _build_requests(lm_task, num_fewshot, limit, seed, skip=skip)
        if draw and len(lm_task.eval_docs) < skip + limit:
            raise ValueError(f"calibration draw {draw} needs documents {skip} to {skip + limit - 1} of {calib!r}, which "
                             f"has {len(lm_task.eval_docs)}: use a smaller calib.seed or calib.num_samples")

    sequences: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for instance in lm_task.instances:
        if instance.doc_id < skip:
            continue  # an exemplar of every other document
        if instance.request_type != "loglikelihood":
            raise ValueError(
                f"{calib!r} makes {instance.request_type!r} requests; calibration_requests "
                f"supports loglikelihood (multiple-choice) tasks only"
            )
        context_ids, continuation_ids = encode_request(tokenizer, *instance.args)
        ids = context_ids + continuation_ids
        if max_length is not None:
            ids = ids[-(max_length + 1) :]
        ids = ids[:-1]
        key = tuple(ids)
        if key not in seen:
            seen.add(key)
            sequences.append(ids)
    return sequences


def _build_requests(lm_task: Task, num_fewshot: int | None, limit: int | float | None, seed: int,
                    skip: int = 0) -> None:
    """Build `lm_task.instances` with the settings simple_evaluate would apply (and `skip` more documents, which
    the caller leaves out)."""
    if num_fewshot is not None:
        lm_task.set_config(key="num_fewshot", value=num_fewshot)
    elif lm_task.get_config("num_fewshot") is None:
        lm_task.set_config(key="num_fewshot", value=0)
    lm_task.set_fewshot_seed(seed=seed)
    n_docs = None
    if limit is not None:  # lm-eval's get_sample_size rule
        n_docs = math.ceil(len(lm_task.eval_docs) * limit) if limit < 1.0 else int(limit)
        n_docs = min(n_docs + skip, len(lm_task.eval_docs))
    lm_task.build_all_requests(limit=n_docs, rank=0, world_size=1)

