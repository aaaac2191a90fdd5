"""Run lm-eval on an already-loaded (possibly sparsified) transformers model: ``evaluate_tasks``.

Tasks come from toptheta.evaluation.tasks (stock lm-eval tasks with a local or hub data source,
their `_calibration` variants, and `smoke`) or from lm-eval (``task_loading`` finds and checks them). The data
source is resolved once per call by tasks.resolve_data_dir: a directory, `"auto"` ($TOPTHETA_DATA_DIR, else the
copy shipped in toptheta/data), or None / `"hub"` (the Hugging Face hub). All argument, task-name and data-file
checks run before lm-eval builds anything and before the model is touched, so a typo fails in milliseconds rather
than after model loading. The token sequences of a task's calibration split come from ``calibration_inputs``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM

from ..compat import encode_request, hflm_max_length  # noqa: F401  (importable from here, as before)
from ..config import is_int
from .batched_lm import BatchedHFLM
from .calibration_inputs import calibration_requests  # noqa: F401  (importable from here, as before)
from .longbench import NO_CHAT_TEMPLATE
from .longbench_lm import MiddleTruncatingHFLM
from .shared_context_lm import SharedContextHFLM
from .task_loading import (  # noqa: F401  (check_external_tasks, is_catalogued: importable from here, as before)
    check_external_tasks,
    check_run_args,
    check_sampler,
    data_sources,
    is_catalogued,
    load_tasks,
    needs_stock,
    task_manager,
)
from .tasks import check_tasks, fewshot_source, is_longbench, resolve_data_dir, task_include_paths

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


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
    check_run_args(num_fewshot, limit, batch_size, max_length)
    check_sampler(fewshot_sampler)
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

    with task_include_paths(ours, resolved) as include_paths:
        manager = task_manager(include_paths + user_paths, stock=needs_stock(external, user_paths))
        # Datasets load here, still before the model is wrapped: data errors surface first.
        loaded = load_tasks(manager, tasks, resolved, fewshot_sampler)
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
        "data_sources": data_sources(tasks, resolved),
        "fewshot_deviations": deviations,
    }
    return results


SCORING = ("shared", "batched", "stock")


def _lm_class(scoring: str) -> type:
    """The lm-eval model class of a `scoring` option (see evaluate_tasks)."""
    return {"shared": SharedContextHFLM, "batched": BatchedHFLM, "stock": HFLM}[scoring]
