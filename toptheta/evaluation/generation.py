"""Generation tasks (HumanEval, passkey retrieval, ruler): what each runs, checks first, and how it is scored.

Each task returns a dict shaped like lm-eval's results (``{"results": {task: {"metric,none": v,
"metric_stderr,none": s}}, "samples": [...]}``, ``long_context.task_result``) so the results store treats every
task alike. The prompts are decoded greedily by ``greedy.generate_all`` inside the caller's ``toptheta.sparsify``
block; passkey and ruler run length by length, resumable (``long_context.by_length``).
"""

from __future__ import annotations

import contextlib
import random
import time
from typing import Callable

from tqdm.auto import tqdm

from ..registry import register_task_kind, task_kind
from .batched_generation import unsupported_settings
from .greedy import encode_prompt, generate_all  # noqa: F401  (encode_prompt: scripts import it from here)
from .humaneval import evaluate_completions, extract_code, load_problems, truncate_at_stop
from .long_context import Paused, by_length, task_result  # noqa: F401  (Paused: the pipeline catches it from here)
from .model_facts import has_sliding_window
from .passkey import build_passkey_records, score_passkey
from .ruler_run import ruler_new_tokens, ruler_target_prompts, run_ruler
from .sandbox import SandboxLimits, require_isolation

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function in one "
                         "```python code block, without tests or explanations.\n\n```python\n{prompt}```")


def run_humaneval(task: dict, model, tokenizer, *, chat_template: bool) -> dict:
    """Pass@1 with greedy decoding; prompt + completion ≤ max_length tokens (2048 in the paper)."""
    allow_unsafe = bool(task.get("allow_unsafe_code", False))
    require_isolation(allow_unsafe)  # refuse in a second, before any generation, if code cannot be isolated
    problems = load_problems(limit=task.get("limit"))
    prompts = humaneval_prompts([p.prompt for p in problems.values()], chat_template=chat_template)
    with tqdm(total=len(prompts), desc="humaneval", unit="problem") as bar:
        outputs = humaneval_decode(task, model, tokenizer, prompts, chat_template=chat_template, progress=bar)
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
    return task_result("humaneval", "pass@1", [float(s["passed"]) for s in samples], samples)


def humaneval_prompts(functions: list[str], *, chat_template: bool) -> list[str]:
    """What the model is given for each function prompt (a signature and its docstring): the instruction around it
    for a chat model, the bare prompt to continue otherwise."""
    return [HUMANEVAL_INSTRUCTION.format(prompt=f) if chat_template else f for f in functions]


def humaneval_decode(task: dict, model, tokenizer, prompts: list[str], *, chat_template: bool,
                     progress=None) -> list[dict]:
    """HumanEval's decoding: greedy until the end of the answer, prompt (as the model sees it) + completion ≤
    task.max_length tokens (2048 in the paper), task.decode_batch prompts at a time."""
    max_length = int(task.get("max_length") or 2048)
    return generate_all(model, tokenizer, prompts, max_new_tokens=lambda n: max_length - n,
                        chat_template=chat_template, decode_batch=int(task.get("decode_batch") or 1),
                        share_prefix=bool(task.get("share_prefix")), progress=progress)


TARGET_DRAW_SEED = 7_919  # HumanEval's target prompts: python_code's train split shuffled by this seed + the draw


def humaneval_target_prompts(task: dict, tokenizer, count: int, draw: int, *, chat_template: bool) -> list[str]:
    """``count`` prompts shaped as HumanEval's (a function's signature and docstring, in the same instruction) from
    python_code's train split, documented standard-library functions that are no HumanEval problem: the rows a
    matched HumanEval run resolves ``sparsifier.target_kept`` on, decoded to the end as the task decodes
    (``humaneval_decode``). A V-row fraction depends on the rows' lengths, so the prompts follow HumanEval's length
    distribution: the i-th is the document whose prompt (as the model sees it) is nearest in tokens to the
    (i + ½)/count quantile of the problems' prompts (their lengths only, never their text). ``draw`` (calib.seed)
    shuffles the documents first, which decides between documents of equal length."""
    from .tasks.static.python_code_data import python_code_documents

    def tokens(prompts: list[str]) -> list[int]:
        return [len(encode_prompt(tokenizer, p, chat_template=chat_template)) for p in prompts]

    documents = python_code_documents("train")
    random.Random(TARGET_DRAW_SEED + draw).shuffle(documents)
    candidates = humaneval_prompts([d["prompt"] for d in documents], chat_template=chat_template)
    if count > len(candidates):
        raise ValueError(f"HumanEval's target rows: {count} prompts asked, python_code's train split has "
                         f"{len(candidates)}")
    problems = sorted(tokens(humaneval_prompts([p.prompt for p in load_problems().values()],
                                               chat_template=chat_template)))
    lengths, chosen = tokens(candidates), []
    for i in range(count):
        want = problems[min(len(problems) - 1, int((i + 0.5) / count * len(problems)))]
        free = [j for j in range(len(candidates)) if j not in chosen]
        chosen.append(min(free, key=lambda j: abs(lengths[j] - want)))  # ties: the draw's order
    return [candidates[j] for j in chosen]


def _sandbox_limits(task: dict):
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
    out = task_result("passkey", "accuracy", [float(s["correct"]) for s in samples], samples)  # fractions, as in the store
    for length in lengths:
        sub = [float(s["correct"]) for s in samples if s["target_tokens"] == length]
        out["results"][f"passkey_{length}"] = task_result("", "accuracy", sub, [])["results"][""]
    if task_stats:
        out["task_stats"] = task_stats
    if resumed:
        out["resumed"] = resumed
    return out


PASSKEY_NEW_TOKENS = 12
CHAT_OVERHEAD_TOKENS = 64  # a chat template's system and role tokens around the prompt (SmolLM2, Qwen2.5: < 40)


def check_context(task: dict, max_positions: int | None, model_name: str) -> None:
    """Refuse, before any prompt runs, a generation task whose sequences exceed the model's context."""
    entry = task_kind(str(task["kind"]))
    if max_positions and entry.check_context is not None:
        entry.check_context(task, max_positions, model_name)


def _lengths_fit(new_tokens: int):
    """The context rule of a task run at task.lengths, answering with ``new_tokens(task)`` tokens."""
    def check(task: dict, max_positions: int, model_name: str) -> None:
        longest, extra = max(task.get("lengths") or (0,)), CHAT_OVERHEAD_TOKENS + new_tokens(task)
        if longest + extra > max_positions:
            fitting = [n for n in (task.get("lengths") or ()) if n + extra <= max_positions]
            raise ValueError(
                f"task.lengths reaches {longest} tokens but {model_name} has a context of {max_positions} positions; "
                f"use lengths that fit, e.g. task.lengths={fitting or '[1024]'}, or a longer-context model "
                "(model=qwen2.5-coder-0.5b has 32k)"
            )
    return check


def _humaneval_fits(task: dict, max_positions: int, model_name: str) -> None:
    if int(task.get("max_length") or 2048) > max_positions:
        raise ValueError(f"task.max_length={task.get('max_length')} exceeds {model_name}'s context of "
                         f"{max_positions} positions; set task.max_length={max_positions} or lower")


def check_decoding(task: dict, model) -> None:
    """Refuse, before any prompt runs, decoding options (task.decode_batch, task.share_prefix) the model cannot honour."""
    batched, shared = int(task.get("decode_batch") or 1) > 1, bool(task.get("share_prefix"))
    if shared:
        if has_sliding_window(model):
            raise ValueError("task.share_prefix=true cuts the KV cache at each prompt's shared prefix, which "
                             "sliding-window layers (they roll their cache) cannot do; leave task.share_prefix unset")
    if not (batched or shared):
        return
    ignored = unsupported_settings(model)
    if ignored:
        option = f"task.decode_batch={task['decode_batch']}" if batched else "task.share_prefix=true"
        raise ValueError(f"{option} decodes greedily without model.generate's logits processors, but this model's "
                         f"generation_config sets {', '.join(ignored)}; leave it unset (one prompt at a time "
                         "through model.generate)")


def evaluate_generation(task: dict, model, tokenizer, *, chat_template: bool, stats=None, checkpoint=None,
                        stop: Callable[[], bool] | None = None) -> dict:
    """Results shaped like lm-eval's; ``task_stats`` (when present) holds statistics of sub-tasks (from ``stats``);
    ``checkpoint``: a directory where a passkey run saves each finished length and resumes from, ``stop``: asked
    between lengths whether to pause there (run_passkey). The task's kind is looked up in the registry."""
    return task_kind(str(task["kind"])).run(task, model, tokenizer, chat_template=chat_template, stats=stats,
                                            checkpoint=checkpoint, stop=stop)


# ---- the registered generation tasks ----------------------------------------------------------------------------

def _humaneval_isolated(task: dict) -> None:
    require_isolation(bool(task.get("allow_unsafe_code", False)))  # no unisolated code execution


@register_task_kind("humaneval", check_context=_humaneval_fits, before_load=_humaneval_isolated,
                    target_prompts=humaneval_target_prompts, target_decode=humaneval_decode)
def _humaneval(task: dict, model, tokenizer, *, chat_template: bool, **_) -> dict:
    return run_humaneval(task, model, tokenizer, chat_template=chat_template)


register_task_kind("passkey", check_context=_lengths_fit(lambda task: PASSKEY_NEW_TOKENS))(run_passkey)
register_task_kind("ruler", check_context=_lengths_fit(ruler_new_tokens), target_prompts=ruler_target_prompts)(run_ruler)
