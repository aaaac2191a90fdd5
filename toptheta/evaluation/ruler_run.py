"""The ruler task (``task=ruler``): the suite of ``ruler.py`` generated, decoded greedily and scored, with its
numbers and sparsity statistics per length, per sub-task and per (length, sub-task).

Like passkey (``generation.run_passkey``), each finished length is saved (``long_context.by_length``) and read
back when the run resumes, and the stop file pauses a run between lengths. With ``task.share_prefix`` each
haystack's prompts go to ``generate_all`` together, so the haystack they share runs once (``prefix_sharing``);
otherwise a sub-task's prompts of one length go together (``task.decode_batch`` batches them).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

from ..attention.stats import SparsityStats
from .greedy import generate_all
from .long_context import by_length, task_result
from .ruler import RulerSettings, build_ruler_records, score_ruler

log = logging.getLogger("toptheta")

DEFAULT_LENGTHS = (4096, 8192)
DEFAULT_PROMPTS_PER_LENGTH = 50
TARGET_SEED = 1_000_003  # target prompts' seeds start here: never a seed the task evaluates (task.seed is small)


def ruler_settings(task: dict) -> RulerSettings:
    """The task's knobs (``task.ruler``; unset ones at RulerSettings' defaults), checked."""
    knobs = dict(task.get("ruler") or {})
    if "subtasks" in knobs:
        knobs["subtasks"] = list(knobs["subtasks"])
    return RulerSettings(**knobs).check()


def ruler_new_tokens(task: dict) -> int:
    """The longest generation a prompt of this task may make (the context check adds it to the longest length)."""
    settings = ruler_settings(task)
    return max(settings.new_tokens(subtask) for subtask in settings.subtasks)


def ruler_records(task: dict, tokenizer) -> list[dict]:
    """The task's prompts (ruler.build_ruler_records from its lengths, prompts_per_length, seed and knobs), the first
    ``task.limit`` of them when set."""
    records = build_ruler_records(tokenizer, lengths=task.get("lengths") or DEFAULT_LENGTHS,
                                  prompts_per_length=int(task.get("prompts_per_length") or DEFAULT_PROMPTS_PER_LENGTH),
                                  seed=int(task.get("seed") or 0), settings=ruler_settings(task))
    return records[: int(task["limit"])] if task.get("limit") else records


def ruler_target_prompts(task: dict, tokenizer, count: int, draw: int, *, chat_template: bool = True) -> list[str]:
    """``count`` prompts built as the task's own (its lengths, sub-tasks and knobs, spread evenly over the lengths)
    from another seed, so none is an evaluated prompt: the rows ``sparsifier.target_kept`` is resolved on. (The chat
    template is applied where the prompts are encoded, as for the evaluated ones.)"""
    lengths = task.get("lengths") or DEFAULT_LENGTHS
    per_length = -(-count // len(lengths))
    records = build_ruler_records(tokenizer, lengths=lengths, prompts_per_length=per_length,
                                  seed=TARGET_SEED + int(task.get("seed") or 0) + draw, settings=ruler_settings(task))
    by_length = [[r["prompt"] for r in records if r["target_tokens"] == n] for n in sorted(set(lengths))]
    interleaved = [prompt for group in zip(*by_length) for prompt in group]  # every length among the first rows
    return interleaved[:count]


def _generate(model, tokenizer, group: list[dict], task: dict, *, chat_template: bool, bar) -> list[dict]:
    """generate_all's outputs for records of one sub-task, in order: per haystack when prompts share their prefix."""
    share = bool(task.get("share_prefix"))
    batches = ([[r for r in group if r["haystack"] == h] for h in dict.fromkeys(r["haystack"] for r in group)]
               if share else [group])
    outputs = []
    for batch in batches:
        outputs += generate_all(model, tokenizer, [r["prompt"] for r in batch],
                                max_new_tokens=[r["new_tokens"] for r in batch], chat_template=chat_template,
                                decode_batch=int(task.get("decode_batch") or 1), share_prefix=share, progress=bar)
    return outputs


def _run_length(model, tokenizer, group: list[dict], task: dict, *, chat_template: bool, stats, bar) -> tuple:
    """(the length's statistics or None, {samples, seconds, subtask_stats}): each sub-task's prompts run in a
    statistics section of their own, inside the length's."""
    t0, samples, subtask_stats = time.time(), [], {}
    with stats.section() if stats is not None else contextlib.nullcontext() as part:
        for subtask in dict.fromkeys(r["subtask"] for r in group):  # a length's records are grouped by sub-task
            records = [r for r in group if r["subtask"] == subtask]
            with stats.section() if stats is not None else contextlib.nullcontext() as sub:
                outputs = _generate(model, tokenizer, records, task, chat_template=chat_template, bar=bar)
            samples += [_sample(r, out) for r, out in zip(records, outputs)]
            if sub is not None:
                subtask_stats[subtask] = sub.to_json()
    return part, {"samples": samples, "seconds": round(time.time() - t0, 2), "subtask_stats": subtask_stats}


def run_ruler(task: dict, model, tokenizer, *, chat_template: bool, stats=None, checkpoint=None,
              stop: Callable[[], bool] | None = None) -> dict:
    """Scores of the suite: ``ruler`` (every prompt), ``ruler_<length>``, ``ruler_<subtask>`` and
    ``ruler_<length>_<subtask>``, each the mean score with its standard error; with the session's ``stats`` the
    sparsity statistics of each of these views but the first under ``task_stats`` (the run's are the first's).
    ``checkpoint`` and ``stop`` as for passkey (``generation.run_passkey``)."""
    records = ruler_records(task, tokenizer)
    samples, task_stats, resumed, by_subtask = [], {}, {}, {}
    lengths = sorted({r["target_tokens"] for r in records})

    def run_length(length: int, group: list[dict], bar) -> tuple:
        return _run_length(model, tokenizer, group, task, chat_template=chat_template, stats=stats, bar=bar)

    for length, part, done in by_length(records, "ruler", run_length, checkpoint=checkpoint, stats=stats, stop=stop,
                                        resumed=resumed):
        samples += done["samples"]
        if part is not None:
            task_stats[f"ruler_{length}"] = part.summary()
        for subtask, counters in done["subtask_stats"].items():
            sub = SparsityStats.from_json(counters)
            task_stats[f"ruler_{length}_{subtask}"] = sub.summary()
            if subtask in by_subtask:
                by_subtask[subtask].add(sub)
            else:
                by_subtask[subtask] = sub
    task_stats.update({f"ruler_{subtask}": pooled.summary() for subtask, pooled in by_subtask.items()})
    out = task_result("ruler", "score", [s["score"] for s in samples], samples)
    subtasks = list(dict.fromkeys(s["subtask"] for s in samples))
    views = [(f"ruler_{n}", lambda s, n=n: s["target_tokens"] == n) for n in lengths]
    views += [(f"ruler_{t}", lambda s, t=t: s["subtask"] == t) for t in subtasks]
    views += [(f"ruler_{n}_{t}", lambda s, n=n, t=t: s["target_tokens"] == n and s["subtask"] == t)
              for n in lengths for t in subtasks]
    for name, belongs in views:
        scores = [s["score"] for s in samples if belongs(s)]
        if scores:
            out["results"][name] = task_result("", "score", scores, [])["results"][""]
    if task_stats:
        out["task_stats"] = task_stats
    if resumed:
        out["resumed"] = resumed
    return out


def _sample(record: dict, out: dict) -> dict:
    score = score_ruler(out["text"], record)
    return {"id": record["id"], "subtask": record["subtask"], "haystack": record["haystack"],
            "target_tokens": record["target_tokens"], "length_tokens": out["prompt_tokens"], "depth": record["depth"],
            "generation": out["text"], "answer": record["answer"], "score": score, "correct": score == 1.0}
