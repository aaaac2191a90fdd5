#!/usr/bin/env python
"""Batched greedy decoding against one prompt at a time, on HumanEval prompts, side by side in one process.

What ``task.decode_batch`` buys a generation task: the first --problems HumanEval prompts (chat template, the
humaneval task's instruction, prompt + completion ≤ --max-length tokens) decoded by ``generation.generate_all``
with decode_batch 1 (one ``model.generate`` per prompt: the reference) and with --batch. Reported: wall seconds,
generated tokens, tokens per second, the speed ratio, and how many completions are identical to the reference
(a batch's GEMMs round differently, so a near-tie can change a greedy token and everything after it).

Usage:  python scripts/bench_generate.py                      (Qwen2.5-Coder-0.5B, 16 problems, batch 16: ~15 min)
        python scripts/bench_generate.py --problems 4 --batch 4 --max-length 512   (a quick check)
Outputs: results/bench/generate.{json,md} (the command on the first line of each).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from toptheta.evaluation.generation import HUMANEVAL_INSTRUCTION, generate_all  # noqa: E402
from toptheta.evaluation.humaneval import load_problems  # noqa: E402
from toptheta.models import load_model  # noqa: E402
from toptheta.results import bench_report  # noqa: E402


def run(model, tokenizer, prompts: list[str], max_length: int, batch: int) -> dict:
    t0 = time.time()
    with torch.no_grad():
        outputs = generate_all(model, tokenizer, prompts, max_new_tokens=lambda n: max_length - n, chat_template=True,
                               decode_batch=batch)
    seconds = time.time() - t0
    tokens = sum(len(tokenizer(o["text"], add_special_tokens=False).input_ids) for o in outputs)
    return {"decode_batch": batch, "seconds": round(seconds, 2), "generated_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 3), "texts": [o["text"] for o in outputs]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--problems", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-length", type=int, default=2048, help="prompt + completion tokens, as task.max_length")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU count)")
    p.add_argument("--out", default="results/bench/generate", help="output stem: writes STEM.json and STEM.md")
    args = p.parse_args(argv)
    if args.problems < 1 or args.batch < 2:
        p.error("--problems must be >= 1 and --batch >= 2 (batch 1 is the reference it is compared with)")
    command = bench_report.command_line("bench_generate.py", argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model, tokenizer, _ = load_model(args.model)
    problems = load_problems(limit=args.problems)
    prompts = [HUMANEVAL_INSTRUCTION.format(prompt=pr.prompt) for pr in problems.values()]
    meta = bench_report.machine(model=args.model, problems=args.problems, max_length=args.max_length)
    one = run(model, tokenizer, prompts, args.max_length, 1)
    print(f"one at a time: {one['seconds']} s, {one['tokens_per_s']} tokens/s", flush=True)
    batched = run(model, tokenizer, prompts, args.max_length, args.batch)
    print(f"batch {args.batch}: {batched['seconds']} s, {batched['tokens_per_s']} tokens/s", flush=True)
    bench_report.finish(meta)
    same = sum(a == b for a, b in zip(one["texts"], batched["texts"]))
    summary = {"speedup": round(one["seconds"] / batched["seconds"], 2), "identical_completions": same}

    lines = ["# Batched greedy decoding (task.decode_batch)", "",
             f"{args.model}, the first {args.problems} HumanEval prompts (chat template), prompt + completion ≤ "
             f"{args.max_length} tokens, dense attention. {bench_report.describe(meta)}", "",
             "| decode_batch | seconds | generated tokens | tokens/s | speed ×(one at a time) |", "|---:|---:|---:|---:|---:|"]
    for r in (one, batched):
        lines.append(f"| {r['decode_batch']} | {r['seconds']:.1f} | {r['generated_tokens']} | {r['tokens_per_s']:.2f} | "
                     f"{one['seconds'] / r['seconds']:.2f} |")
    lines += ["", f"Completions identical to one at a time: {same} of {args.problems}."]
    bench_report.write(args.out, command, meta, {"summary": summary, "runs": [one, batched]}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
