"""Long-context generation tasks (passkey, ruler) run length by length, each finished length saved and resumable.

A context of 16k tokens takes hours on a CPU, so ``by_length`` saves each finished length (its samples and its
statistics' counters) in the run's checkpoint directory and reads it back when the run resumes; a stop file pauses
a run between lengths (``Paused``). ``task_result`` shapes a task's numbers like lm-eval's results.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from tqdm.auto import tqdm

from ..atomic import write_text_atomic
from ..attention.stats import SparsityStats

log = logging.getLogger("toptheta")


def task_result(task: str, metric: str, values: list[float], samples: list[dict], scale: float = 1.0) -> dict:
    """``{"results": {task: {"<metric>,none": mean, "<metric>_stderr,none": standard error}}, "samples"}``,
    lm-eval's shape, so the results store treats a generation task like an lm-eval one."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"results": {task: {f"{metric},none": mean * scale, f"{metric}_stderr,none": math.sqrt(var / n) * scale}},
            "samples": samples}


def by_length(records: list[dict], name: str, run_length, *, checkpoint, stats, stop, resumed: dict):
    """Each length of a long-context task, in increasing order: ``(length, part, done)``, the length's statistics
    section and its ``{"samples", "seconds", ...}``, read back from ``checkpoint`` when saved there for the same
    prompts (its counters added to ``stats``, ``resumed["<name>_<length>"]`` set), else made by
    ``run_length(length, records of that length, progress bar)`` and saved. ``stop``, asked before each length left
    to generate, raises ``Paused`` there when it returns true (with a checkpoint: the lengths done stay saved)."""
    with tqdm(total=len(records), desc=name, unit="prompt") as bar:
        for length in sorted({r["target_tokens"] for r in records}):
            group = [r for r in records if r["target_tokens"] == length]
            saved = read_section(checkpoint, length, group, stats, name=name)
            if saved is not None:
                part, done = saved
                if part is not None:
                    stats.add(part)
                resumed[f"{name}_{length}"] = done["seconds"]
                log.info("%s %d: %d prompts read back from %s", name, length, len(group), checkpoint)
                bar.update(len(group))
            else:
                if checkpoint is not None and stop is not None and stop():
                    raise Paused(f"stopped before {name} length {length}; the lengths before it are saved in "
                                 f"{checkpoint}")
                part, done = run_length(length, group, bar)
                write_section(checkpoint, length, group, done, part, name=name)
            yield length, part, done


class Paused(Exception):
    """A run stopped at a boundary of its saved parts (the stop file appeared); rerunning it resumes there."""


def _section_path(checkpoint, length: int, name: str = "passkey") -> Path:
    return Path(checkpoint) / f"{name}_{length}.json"


def read_section(checkpoint, length: int, group: list[dict], stats, name: str = "passkey"):
    """(its statistics or None, {samples, seconds, ...: what else was saved}) of a length of task ``name`` saved for
    exactly these prompts; else None. (Any numbered part of a run saved by write_section: ruler's batches too.)"""
    if checkpoint is None or not _section_path(checkpoint, length, name).is_file():
        return None
    data = json.loads(_section_path(checkpoint, length, name).read_text(encoding="utf-8"))
    if data.get("prompts") != [r["prompt"] for r in group] or (data.get("stats") is None) != (stats is None):
        log.warning("%s %d: the checkpoint in %s was made for other prompts; generating again", name, length,
                    checkpoint)
        return None
    part = SparsityStats.from_json(data["stats"]) if data["stats"] is not None else None
    return part, {key: value for key, value in data.items() if key not in ("prompts", "stats")}  # samples, seconds, ...


def write_section(checkpoint, length: int, group: list[dict], done: dict, part, name: str = "passkey") -> None:
    if checkpoint is None:
        return
    path = _section_path(checkpoint, length, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"prompts": [r["prompt"] for r in group], **done, "stats": part.to_json() if part is not None else None}
    write_text_atomic(path, json.dumps(data))
