"""The token sequences a task's calibration (train) split feeds the model: what calibration runs on.

``calibration_requests`` builds a task's calibration variant through lm-eval (its prompts, few-shot sampling and
`limit` rules), then turns each loglikelihood request into the model input HFLM would build for it, without a model
(``compat.encode_request``). ``thresholds_cache`` and ``matched`` call it; so do the benchmarks.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from ..compat import encode_request
from .task_loading import check_run_args, check_sampler, load_tasks, task_manager
from .tasks import calibration_name, check_tasks, resolve_data_dir, task_include_paths

if TYPE_CHECKING:
    from lm_eval.api.task import Task
    from transformers import PreTrainedTokenizerBase


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
    check_run_args(num_fewshot, limit, 1, max_length)
    check_sampler(fewshot_sampler)
    skip = (num_fewshot or 0) + reserve if fewshot_sampler == "first_n" else 0
    if draw:
        if not isinstance(limit, int) or limit < 1 or draw < 0:
            raise ValueError(f"calibration draw {draw} needs a whole number of calibration documents (calib.num_samples"
                             f"=64, say) and a draw >= 0; got num_samples={limit!r}")
        skip += draw * limit
    calib = calibration_name(task) if isinstance(task, str) else task
    lm_task = built_task(calib, data_dir, num_fewshot, limit, seed, fewshot_sampler, skip=skip)
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


def evaluated_requests(tokenizer: PreTrainedTokenizerBase, task: str, *, data_dir: str | os.PathLike[str] | None,
                       num_fewshot: int | None, limit: int | None, seed: int = 1234,
                       fewshot_sampler: str | None = None) -> list[tuple[int, int, list[int], list[int]]]:
    """(doc_id, choice, context ids, continuation ids) of every loglikelihood request of `task`'s evaluated split,
    its first `limit` documents, as an evaluation run builds them (the same prompts and exemplars; untruncated).
    For analyses that replay what a run scored (scripts/kept_by_row.py)."""
    check_run_args(num_fewshot, limit, 1, None)
    check_sampler(fewshot_sampler)
    lm_task = built_task(task, data_dir, num_fewshot, limit, seed, fewshot_sampler)
    return [(instance.doc_id, instance.idx, *encode_request(tokenizer, *instance.args))
            for instance in lm_task.instances if instance.request_type == "loglikelihood"]


def built_task(task: str, data_dir: str | os.PathLike[str] | None, num_fewshot: int | None,
               limit: int | float | None, seed: int, fewshot_sampler: str | None, skip: int = 0) -> Task:
    """`task` loaded through lm-eval from `data_dir` (checked first) with its requests built (``build_requests``)."""
    resolved = resolve_data_dir(data_dir)
    check_tasks([task], resolved, num_fewshot)
    with task_include_paths([task], resolved) as include_paths:
        lm_task = load_tasks(task_manager(include_paths), [task], resolved, fewshot_sampler)[task]
        build_requests(lm_task, num_fewshot, limit, seed, skip=skip)
    return lm_task


def build_requests(lm_task: Task, num_fewshot: int | None, limit: int | float | None, seed: int,
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
