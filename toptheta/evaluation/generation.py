"""Generation tasks (HumanEval, passkey retrieval): greedy decoding through the KV cache.

Each task returns a dict shaped like lm-eval's results (``{"results": {task: {"metric,none": v,
"metric_stderr,none": s}}, "samples": [...]}``) so the results store treats every task alike.
Decoding happens inside the caller's ``toptheta.sparsify`` block, so prefill rows count kept
attention elements and every decode step counts kept V rows.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..attention.cache import growing_cache

log = logging.getLogger("toptheta")

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function in one "
                         "```python code block, without tests or explanations.\n\n```python\n{prompt}```")


def encode_prompt(tokenizer, prompt: str, *, chat_template: bool = False) -> list[int]:
    """The prompt's token ids, wrapped in the tokenizer's chat template if asked and it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def greedy_generate(model, tokenizer, prompt: str, *, max_new_tokens: int, chat_template: bool = False) -> tuple[str, int]:
    """Greedy continuation of ``prompt`` (chat-wrapped if asked); returns (text, prompt tokens)."""
    ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    return tokenizer.decode(_generate_ids(model, tokenizer, ids, max_new_tokens), skip_special_tokens=True), len(ids)


def _generate_ids(model, tokenizer, ids: list[int], max_new_tokens: int) -> list[int]:
    """The greedy continuation of the token ids ``ids`` through ``model.generate``: the reference path."""
    if max_new_tokens < 1:
        return []
    prompt = torch.tensor([ids], device=model.device)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                         do_sample=False, num_beams=1, pad_token_id=pad_token_id(tokenizer),
                         cache=growing_cache(model))  # no re-concatenation of the whole cache per token
    return out[0, len(ids):].tolist()


def pad_token_id(tokenizer) -> int:
    """The token that pads a batch: the tokenizer's pad token, else its end-of-sequence token, else 0."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    return 0


def generate_all(model, tokenizer, prompts: list[str], *, max_new_tokens: int | list[int] | Callable[[int], int],
                 chat_template: bool, decode_batch: int = 1, share_prefix: bool = False, progress=None) -> list[dict]:
    """Greedy continuations of every prompt: ``{"text", "prompt_tokens", "seconds"}`` per prompt, in order.

    ``max_new_tokens``: one limit for all, one per prompt, or a function of a prompt's length in tokens (as the
    model sees it, chat template included), e.g. ``lambda n: max_length - n``. ``decode_batch`` > 1 decodes that
    many prompts together (``batched_generation``; prompts of similar length share a batch, and ``seconds`` is
    then the time from the batch's start to the sequence's end); 1 runs one ``model.generate`` per prompt, the
    reference. ``share_prefix`` runs the leading tokens prompts have in common once (``prefix_sharing``; one prompt
    at a time; ``seconds`` then counts from the call's start).
    """
    encoded = [encode_prompt(tokenizer, p, chat_template=chat_template) for p in prompts]
    if callable(max_new_tokens):
        limits = [max_new_tokens(len(ids)) for ids in encoded]
    elif isinstance(max_new_tokens, int):
        limits = [max_new_tokens] * len(prompts)
    else:
        limits = list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(limits)} token limits")
    results: list[dict | None] = [None] * len(prompts)
    if share_prefix and decode_batch > 1:
        raise ValueError("share_prefix continues one prompt at a time: use decode_batch=1 with it")

    def record(i: int, tokens: list[int], t0: float) -> None:
        results[i] = {"text": tokenizer.decode(tokens, skip_special_tokens=True), "prompt_tokens": len(encoded[i]),
                      "seconds": round(time.time() - t0, 2)}
        if progress is not None:
            progress.update()
    if share_prefix:
        from .batched_generation import eos_ids
        from .prefix_sharing import generate_shared

        t0 = time.time()
        generate_shared(model, encoded, max_new_tokens=limits, pad_token_id=pad_token_id(tokenizer),
                        eos_token_ids=eos_ids(model, tokenizer), on_finish=lambda i, tokens: record(i, tokens, t0))
        return results
    if decode_batch <= 1:
        for i, ids in enumerate(encoded):
            t0 = time.time()
            record(i, _generate_ids(model, tokenizer, ids, limits[i]), t0)
        return results
    from .batched_generation import eos_ids, greedy_generate_batch

    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # little padding within a batch
    eos = eos_ids(model, tokenizer)
    for start in range(0, len(order), decode_batch):
        batch = order[start:start + decode_batch]
        t0 = time.time()

        def finish(j: int, tokens: list[int], batch=batch, t0=t0) -> None:
            record(batch[j], tokens, t0)

        greedy_generate_batch(model, [encoded[i] for i in batch], max_new_tokens=[limits[i] for i in batch],
                              pad_token_id=pad_token_id(tokenizer), eos_token_ids=eos, on_finish=finish)
    return results


def _result(task: str, metric: str, values: list[float], samples: list[dict], scale: float = 1.0) -> dict:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return {"results": {task: {f"{metric},none": mean * scale, f"{metric}_stderr,none": math.sqrt(var / n) * scale}},
            "samples": samples}


def run_humaneval(task: dict, model, tokenizer, *, chat_template: bool) -> dict:
    """Pass@1 with greedy decoding; prompt + completion ≤ max_length tokens (2048 in the paper)."""
    from .humaneval import evaluate_completions, extract_code, load_problems, truncate_at_stop
    from .sandbox import require_isolation

    allow_unsafe = bool(task.get("allow_unsafe_code", False))
    require_isolation(allow_unsafe)  # refuse in a second, before any generation, if code cannot be isolated
    problems = load_problems(limit=task.get("limit"))
    max_length = int(task.get("max_length") or 2048)
    prompts = [HUMANEVAL_INSTRUCTION.format(prompt=p.prompt) if chat_template else p.prompt for p in problems.values()]
    with tqdm(total=len(prompts), desc="humaneval", unit="problem") as bar:  # prompt (as the model sees it) +
        # completion ≤ max_length tokens
        outputs = generate_all(model, tokenizer, prompts, max_new_tokens=lambda n: max_length - n,
                               chat_template=chat_template,
                               decode_batch=int(task.get("decode_batch") or 1),
                               share_prefix=bool(task.get("share_prefix")), progress=bar)
    completions, samples = {}, []
    for (task_id, problem), out in zip(problems.items(), outputs):
        # A chat answer restates the function: prompt + code redefines it, and the redefinition wins.
        text = out["text"]
        completion = extract_code(text, problem.entry_point) if chat_template else truncate_at_stop(text)
        completions[task_id] = [completion]
        samples.append({"task_id": task_id, "generation": text, "completion": completion, "seconds": out["seconds"]})
    report = evaluate_completions(problems, completions, ks=(1,), limits=_sandbox_limits(task),
                                  allow_unsafe_code=allow_unsafe)
    verdicts = {r.task_id: r for r in report.results}
    for s in samples:
        s.update(passed=verdicts[s["task_id"]].passed, status=verdicts[s["task_id"]].status)
    return _result("humaneval", "pass@1", [float(s["passed"]) for s in samples], samples)


def _sandbox_limits(task: dict):
    from .sandbox import SandboxLimits

    return SandboxLimits(timeout_s=float(task.get("timeout_s", 3.0)))


def run_passkey(task: dict, model, tokenizer, *, chat_template: bool, stats=None, checkpoint=None,
                stop: Callable[[], bool] | None = None) -> dict:
    """Passkey retrieval at each length and depth: accuracy overall and per length.

    With the session's ``stats`` (a SparsityStats), each length also gets its own sparsity statistics
    (``task_stats["passkey_<length>"]``): kept fractions are not pooled across context lengths.

    ``checkpoint`` (a directory): each finished length is saved there (its samples and its statistics' counters),
    and a length already saved for the same prompts is read back instead of generated again, its counters added
    to ``stats``: an interrupted run (a long context takes hours here) resumes at the length it was in, with the
    numbers an uninterrupted run gives. The results then name the lengths read back (``resumed``). With a
    checkpoint, ``stop`` (asked before each length left to generate) returning true raises ``Paused`` there: the
    lengths done stay saved.
    """
    import contextlib

    from .passkey import build_passkey_records, score_passkey

    records = build_passkey_records(tokenizer, lengths=task.get("lengths") or (1024, 2048, 4096, 8192, 16384),
                                    depths=task.get("depths") or (0.1, 0.5, 0.9), seed=int(task.get("seed", 0)),
                                    filler=task.get("filler") or "independent")
    if task.get("limit"):
        records = records[: int(task["limit"])]
    samples, task_stats, resumed = [], {}, {}

    def run_length(length: int, group: list[dict], bar) -> tuple:
        t0, done = time.time(), []
        with stats.section() if stats is not None else contextlib.nullcontext() as part:
            outputs = generate_all(model, tokenizer, [r["prompt"] for r in group],
                                   max_new_tokens=PASSKEY_NEW_TOKENS, chat_template=chat_template,
                                   decode_batch=int(task.get("decode_batch") or 1),
                                   share_prefix=bool(task.get("share_prefix")), progress=bar)
            for record, out in zip(group, outputs):
                done.append({"id": record["id"], "target_tokens": length, "length_tokens": out["prompt_tokens"],
                             "depth": record["depth"], "generation": out["text"],
                             "correct": bool(score_passkey(out["text"], record["answer"]))})
        return part, {"samples": done, "seconds": round(time.time() - t0, 2)}

    lengths = sorted({r["target_tokens"] for r in records})
    for length, part, done in by_length(records, "passkey", run_length, checkpoint=checkpoint, stats=stats,
                                        stop=stop, resumed=resumed):
        samples += done["samples"]
        if part is not None:
            task_stats[f"passkey_{length}"] = part.summary()
    out = _result("passkey", "accuracy", [float(s["correct"]) for s in samples], samples)  # fractions, as in the store
    for length in lengths:
        sub = [float(s["correct"]) for s in samples if s["target_tokens"] == length]
        out["results"][f"passkey_{length}"] = _result("", "accuracy", sub, [])["results"][""]
    if task_stats:
        out["task_stats"] = task_stats
    if resumed:
        out["resumed"] = resumed
    return out


def by_length(records: list[dict], name: str, run_length, *, checkpoint, stats, stop, resumed: dict):
    """Each length of a long-context task, in increasing order: ``(length, part, done)``, the length's statistics
    section and its ``{"samples", "seconds", ...}``, read back from ``checkpoint`` when saved there for the same
    prompts (its counters added to ``stats``, ``resumed["<name>_<length>"]`` set), else made by
    ``run_length(length, records of that length, progress bar)`` and saved. ``stop``, asked before each length left
    to generate, raises ``Paused`` there when it returns true (with a checkpoint: the lengths done stay saved)."""
    with tqdm(total=len(records), desc=name, unit="prompt") as bar:
        for length in sorted({r["target_tokens"] for r in records}):
            group = [r for r in records if r["target_tokens"] == length]
            saved = _read_section(checkpoint, length, group, stats, name=name)
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
                _write_section(checkpoint, length, group, done, part, name=name)
            yield length, part, done


class Paused(Exception):
    """A run stopped at a boundary of its saved parts (the stop file appeared); rerunning it resumes there."""


PASSKEY_NEW_TOKENS = 12
CHAT_OVERHEAD_TOKENS = 64  # a chat template's system and role tokens around the prompt (SmolLM2, Qwen2.5: < 40)


def check_context(task: dict, max_positions: int | None, model_name: str) -> None:
    """Refuse, before any prompt runs, a generation task whose sequences exceed the model's context."""
    if not max_positions:
        return
    if task["kind"] in ("passkey", "ruler"):
        new_tokens = PASSKEY_NEW_TOKENS if task["kind"] == "passkey" else _ruler_new_tokens(task)
        longest = max(task.get("lengths") or (0,))
        need = longest + CHAT_OVERHEAD_TOKENS + new_tokens
        if need > max_positions:
            fitting = [n for n in (task.get("lengths") or ()) if n + CHAT_OVERHEAD_TOKENS + new_tokens
                       <= max_positions]
            raise ValueError(
                f"task.lengths reaches {longest} tokens but {model_name} has a context of {max_positions} positions; "
                f"use lengths that fit, e.g. task.lengths={fitting or '[1024]'}, or a longer-context model "
                "(model=qwen2.5-coder-0.5b has 32k)"
            )
    elif task["kind"] == "humaneval" and int(task.get("max_length") or 2048) > max_positions:
        raise ValueError(f"task.max_length={task.get('max_length')} exceeds {model_name}'s context of "
                         f"{max_positions} positions; set task.max_length={max_positions} or lower")


def _ruler_new_tokens(task: dict) -> int:
    from .ruler_run import ruler_new_tokens  # ruler_run imports this module

    return ruler_new_tokens(task)


def check_decoding(task: dict, model) -> None:
    """Refuse, before any prompt runs, decoding options (task.decode_batch, task.share_prefix) the model cannot honour."""
    batched, shared = int(task.get("decode_batch") or 1) > 1, bool(task.get("share_prefix"))
    if shared:
        from .shared_context_lm import _has_sliding_window

        if _has_sliding_window(model):
            raise ValueError("task.share_prefix=true cuts the KV cache at each prompt's shared prefix, which "
                             "sliding-window layers (they roll their cache) cannot do; leave task.share_prefix unset")
    if not (batched or shared):
        return
    from .batched_generation import unsupported_settings

    ignored = unsupported_settings(model)
    if ignored:
        option = f"task.decode_batch={task['decode_batch']}" if batched else "task.share_prefix=true"
        raise ValueError(f"{option} decodes greedily without model.generate's logits processors, but this model's "
                         f"generation_config sets {', '.join(ignored)}; leave it unset (one prompt at a time "
                         "through model.generate)")


def _section_path(checkpoint, length: int, name: str = "passkey") -> Path:
    return Path(checkpoint) / f"{name}_{length}.json"


def _read_section(checkpoint, length: int, group: list[dict], stats, name: str = "passkey"):
    """(its statistics or None, {samples, seconds, ...: what else was saved}) of a length of task ``name`` saved for
    exactly these prompts; else None."""
    if checkpoint is None or not _section_path(checkpoint, length, name).is_file():
        return None
    data = json.loads(_section_path(checkpoint, length, name).read_text(encoding="utf-8"))
    if data.get("prompts") != [r["prompt"] for r in group] or (data.get("stats") is None) != (stats is None):
        log.warning("%s %d: the checkpoint in %s was made for other prompts; generating again", name, length,
                    checkpoint)
        return None
    from ..attention.stats import SparsityStats

    part = SparsityStats.from_json(data["stats"]) if data["stats"] is not None else None
    return part, {key: value for key, value in data.items() if key not in ("prompts", "stats")}  # samples, seconds, ...


def _write_section(checkpoint, length: int, group: list[dict], done: dict, part, name: str = "passkey") -> None:
    from ..atomic import write_text_atomic

    if checkpoint is None:
        return
    path = _section_path(checkpoint, length, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"prompts": [r["prompt"] for r in group], **done, "stats": part.to_json() if part is not None else None}
    write_text_atomic(path, json.dumps(data))


def evaluate_generation(task: dict, model, tokenizer, *, chat_template: bool, stats=None, checkpoint=None,
                        stop: Callable[[], bool] | None = None) -> dict:
    """Results shaped like lm-eval's; ``task_stats`` (when present) holds statistics of sub-tasks (from ``stats``);
    ``checkpoint``: a directory where a passkey run saves each finished length and resumes from, ``stop``: asked
    between lengths whether to pause there (run_passkey)."""
    kind = task["kind"]
    if kind == "humaneval":
        return run_humaneval(task, model, tokenizer, chat_template=chat_template)
    if kind == "passkey":
        return run_passkey(task, model, tokenizer, chat_template=chat_template, stats=stats, checkpoint=checkpoint,
                           stop=stop)
    if kind == "ruler":
        from .ruler_run import run_ruler

        return run_ruler(task, model, tokenizer, chat_template=chat_template, stats=stats, checkpoint=checkpoint,
                         stop=stop)
    raise ValueError(f"unknown generation task kind {kind!r}; valid: humaneval, passkey, ruler")
