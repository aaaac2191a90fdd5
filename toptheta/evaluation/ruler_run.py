"""The ruler task (``task=ruler``): the suite of ``ruler.py`` generated, decoded greedily and scored, with its
numbers and sparsity statistics per length, per sub-task and per (length, sub-task).

Like passkey (``generation.run_passkey``), each finished length is saved (``long_context.by_length``) and read
back when the run resumes, and the stop file pauses a run between lengths; inside a length, each finished haystack
(or sub-task) is saved too, so a run cut inside a length loses one haystack's prompts at most. With ``task.share_prefix`` each
haystack's prompts go to ``generate_all`` together, so the haystack they share runs once (``prefix_sharing``);
otherwise a sub-task's prompts of one length go together (``task.decode_batch`` batches them).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

from ..attention.stats import SparsityStats
from .greedy import generate_all
from .long_context import by_length, read_section, task_result, write_section
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


def _batches(group: list[dict], task: dict) -> list[list[dict]]:
    """Records of one sub-task as generate_all takes them: per haystack when prompts share their prefix, else one."""
    if not task.get("share_prefix"):
        return [group]
    return [[r for r in group if r["haystack"] == h] for h in dict.fromkeys(r["haystack"] for r in group)]


def _run_length(model, tokenizer, group: list[dict], task: dict, *, chat_template: bool, stats, bar,
                parts: Path | None = None) -> tuple:
    """(the length's statistics or None, {samples, seconds, subtask_stats}): each sub-task's prompts run in a
    statistics section of their own, inside the length's.

    ``parts`` (a directory): each generate_all batch (a haystack's prompts with ``task.share_prefix``, else a
    sub-task's) is saved there as it finishes, outputs and counters, and read back instead of generated when a run
    that stopped inside the length resumes: a length of 8k-token prompts takes an hour here."""
    t0, samples, subtask_stats = time.time(), [], {}
    with stats.section() if stats is not None else contextlib.nullcontext() as part:
        for subtask in dict.fromkeys(r["subtask"] for r in group):  # a length's records are grouped by sub-task
            records = [r for r in group if r["subtask"] == subtask]
            outputs = []
            with stats.section() if stats is not None else contextlib.nullcontext() as sub:
                for i, batch in enumerate(_batches(records, task)):
                    outputs += _batch(model, tokenizer, batch, task, parts, i, subtask, chat_template=chat_template,
                                      stats=stats, bar=bar)
            samples += [_sample(r, out) for r, out in zip(records, outputs)]
            if sub is not None:
                subtask_stats[subtask] = sub.to_json()
    return part, {"samples": samples, "seconds": round(time.time() - t0, 2), "subtask_stats": subtask_stats}


def _batch(model, tokenizer, batch: list[dict], task: dict, parts: Path | None, index: int, subtask: str, *,
           chat_template: bool, stats, bar) -> list[dict]:
    """generate_all's outputs for a sub-task's batch ``index``, read back from ``parts`` when saved there for the same
    prompts (its counters added to ``stats``), else generated and saved there (``<subtask>_<index>.json``)."""
    saved = read_section(parts, index, batch, stats, name=subtask)
    if saved is not None:
        piece, done = saved
        if piece is not None:
            stats.add(piece)
        bar.update(len(batch))
        return done["outputs"]
    with stats.section() if stats is not None else contextlib.nullcontext() as piece:
        outputs = generate_all(model, tokenizer, [r["prompt"] for r in batch],
                               max_new_tokens=[r["new_tokens"] for r in batch], chat_template=chat_template,
                               decode_batch=int(task.get("decode_batch") or 1),
                               share_prefix=bool(task.get("share_prefix")), progress=bar)
    write_section(parts, index, batch, {"outputs": outputs}, piece, name=subtask)
    return outputs


def run_ruler(task: dict, model, tokenizer, *, chat_template: bool, stats=None, checkpoint=None,
              stop: Callable[[], bool] | None = None) -> dict:
    """Scores of the suite: ``ruler`` (every prompt), ``ruler_<length>``, ``ruler_<subtask>`` and
    ``ruler_<length>_<subtask>``, each the mean score with its standard error; with the session's ``stats`` the
    sparsity statistics of each of these views but the first under ``task_stats`` (the run's are the first's).
    ``checkpoint`` and ``stop`` as for passkey (``generation.run_passkey``)."""
    records = ruler_records(task, tokenizer)
    samples, task_stats, resumed, by_subtask = [], {}, {}, {}
    lengths = sorted({r["target_tokens"] for r in records})

    def parts(length: int) -> Path | None:  # where a length's batches are saved until the length is
        return Path(checkpoint, f"ruler_{length}.parts") if checkpoint is not None else None

    def run_length(length: int, group: list[dict], bar) -> tuple:
        return _run_length(model, tokenizer, group, task, chat_template=chat_template, stats=stats, bar=bar,
                           parts=parts(length))

    for length, part, done in by_length(records, "ruler", run_length, checkpoint=checkpoint, stats=stats, stop=stop,
                                        resumed=resumed):
        if checkpoint is not None:
            shutil.rmtree(parts(length), ignore_errors=True)  # the length is saved whole
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
