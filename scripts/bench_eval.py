#!/usr/bin/env python
"""Multiple-choice evaluation benchmark: stock HFLM at batch 1 against batched and shared-context scoring.

One process, one model, the same lm-eval requests. SmolLM2-135M (offline), Top-θ post-softmax + VMC
(layers 0-1 at k = 512, as the runner's default), on the first --limit questions of

    arc_easy       0-shot, k = 16
    arc_challenge  5-shot, k = 64

Methods (toptheta.evaluation.shared_context_lm):

    stock    lm-eval's HFLM, batch_size=1: what the runner did before (one forward per answer choice)
    batched  BatchedHFLM, batch_size="auto": left-padded batches with an attention mask
    shared   SharedContextHFLM, batch_size="auto": each context once, its choices from the cached K/V

Each method scores all requests inside its own ``toptheta.sparsify`` block; the timed call is
``lm.loglikelihood(requests)`` alone (no lm-eval set-up, no metric code). Reported per method: wall
time (min and median over --repeats; on a shared machine the min is the better estimate), speed-up
over stock, acc and acc_norm (lm-eval's own process_results), the largest log-likelihood difference
from stock, and the kept attention fraction. Thresholds are calibrated once per setting on --calib-docs
train documents of the same task and cached under ~/.cache/toptheta/bench/.

Usage:  python scripts/bench_eval.py                                   (100 questions, the shipped data)
        python scripts/bench_eval.py --limit 20 --out results/bench/eval_small
Writes <out>.json and <out>.md (the command on the first line of both).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import toptheta  # noqa: E402
from toptheta.cachedir import cache_dir  # noqa: E402
from toptheta.pipeline import calibrate_on_task  # noqa: E402
from toptheta.results import bench_report  # noqa: E402
from toptheta.evaluation import lm_eval_adapter as adapter  # noqa: E402
from toptheta.evaluation.tasks import check_tasks, resolve_data_dir, task_include_paths  # noqa: E402

SETTINGS = [("arc_easy", 0, 16), ("arc_challenge", 5, 64)]  # (task, num_fewshot, k)
LAYER_K = {0: 512, 1: 512}
METHODS = ("stock", "batched", "shared")


def build_task(task: str, data_dir, num_fewshot: int, limit: int, seed: int = 1234):
    """The lm-eval Task with its loglikelihood requests built as simple_evaluate would build them."""
    check_tasks([task], data_dir, num_fewshot)
    with task_include_paths([task], data_dir) as include_paths:
        lm_task = adapter._load_tasks(adapter._task_manager(include_paths), [task], data_dir)[task]
        adapter._build_requests(lm_task, num_fewshot, limit, seed)
    return lm_task


def thresholds_for(model, tokenizer, task: str, k: int, data_dir, calib_docs: int) -> toptheta.Thresholds:
    """Top-θ post-softmax thresholds from `calib_docs` train documents of `task` (cached)."""
    cache = cache_dir("bench")
    path = cache / f"smollm2-135m_{task}_k{k}_post_docs{calib_docs}.safetensors"
    if path.is_file():
        return toptheta.Thresholds.load(path, model)
    print(f"calibrating k={k} on {calib_docs} documents of {task} train", flush=True)
    thresholds = calibrate_on_task(model, tokenizer, task, data_dir=data_dir, num_fewshot=0, num_samples=calib_docs,
                                   k=k, placement="post", layer_k=LAYER_K, progress=False)
    thresholds.save(path)
    return thresholds


def lm_for(method: str, model, tokenizer):
    from lm_eval.models.huggingface import HFLM

    from toptheta.evaluation.shared_context_lm import BatchedHFLM, SharedContextHFLM

    cls, batch_size = {"stock": (HFLM, 1), "batched": (BatchedHFLM, "auto"), "shared": (SharedContextHFLM, "auto")}[method]
    return cls(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


def score(lm, model, thresholds, instances) -> tuple[list, dict, float]:
    with toptheta.sparsify(model, toptheta.TopTheta(thresholds), [toptheta.VMC()]) as stats:
        t0 = time.perf_counter()
        answers = lm.loglikelihood(instances, disable_tqdm=True)
        seconds = time.perf_counter() - t0
    return answers, stats.summary(), seconds


def accuracy(lm_task, instances, answers) -> dict[str, float]:
    """acc and acc_norm through the task's own process_results."""
    per_doc: dict[int, tuple[dict, list]] = {}
    for instance, answer in zip(instances, answers, strict=True):
        per_doc.setdefault(instance.doc_id, (instance.doc, []))[1].append(answer)
    metrics = [lm_task.process_results(doc, results) for doc, results in per_doc.values()]
    return {name: statistics.fmean(m[name] for m in metrics) for name in ("acc", "acc_norm")}


def forward_tokens(lm, instances) -> dict[str, int]:
    """Token positions each method runs through the model (left-truncation ignored).

    stock and batched: context + continuation per request; shared: each distinct context once, plus every
    continuation. When the linear layers dominate (short rows, as here), stock / shared bounds the
    speed-up that sharing can give.
    """
    pairs = [lm._encode_pair(*instance.args) for instance in instances]
    per_request = sum(len(ctx) + len(cont) - 1 for ctx, cont in pairs)
    shared = sum(len(ctx) for ctx in {tuple(ctx) for ctx, _ in pairs}) + sum(len(cont) - 1 for _, cont in pairs)
    return {"stock": per_request, "batched": per_request, "shared": shared}


def linear_flops(lm, instances, model) -> dict[str, float]:
    """Multiply-adds of the linear layers each method runs (attention left out), in GFLOP.

    The body's weights act on every position a method runs; the LM head (vocabulary × hidden) only where logits
    are computed: stock HFLM computes them at every position, the batched and shared paths at the scored ones
    (shared: one per context, plus the continuations). stock / method is the speed-up bound where the linear
    layers set the cost; unlike the token ratio it credits the LM head rows that are never computed.
    """
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    pairs = [lm._encode_pair(*instance.args) for instance in instances]
    per_request = sum(len(ctx) + len(cont) - 1 for ctx, cont in pairs)
    scored = sum(len(cont) for _, cont in pairs)
    contexts = {tuple(ctx) for ctx, _ in pairs}
    shared_body = sum(len(ctx) for ctx in contexts) + sum(len(cont) - 1 for _, cont in pairs)
    shared_head = len(contexts) + sum(len(cont) - 1 for _, cont in pairs)
    gflop = lambda positions, logits: 2e-9 * (positions * body + logits * head)  # noqa: E731
    return {"stock": gflop(per_request, per_request), "batched": gflop(per_request, scored),
            "shared": gflop(shared_body, shared_head)}


def run_setting(model, tokenizer, task, num_fewshot, k, args, data_dir) -> dict:
    lm_task = build_task(task, data_dir, num_fewshot, args.limit)
    instances = lm_task.instances
    thresholds = thresholds_for(model, tokenizer, task, k, data_dir, args.calib_docs)
    lms = {m: lm_for(m, model, tokenizer) for m in METHODS}
    score(lms["shared"], model, thresholds, instances[:8])  # warm-up: kernels built, caches touched
    rows = {m: {"seconds": []} for m in METHODS}
    for repeat in range(args.repeats):  # methods interleaved, so a noisy stretch hits all of them
        for m in METHODS:
            answers, stats, seconds = score(lms[m], model, thresholds, instances)
            rows[m]["seconds"].append(seconds)
            rows[m].update(answers=answers, stats=stats)
            print(f"{task} {num_fewshot}-shot {m}: {seconds:.1f} s", flush=True)
    stock = rows["stock"]
    tokens = forward_tokens(lms["stock"], instances)
    flops = linear_flops(lms["stock"], instances, model)
    out = {"task": task, "num_fewshot": num_fewshot, "k": k, "documents": len({i.doc_id for i in instances}),
           "requests": len(instances), "methods": {}}
    for m, row in rows.items():
        best, median = min(row["seconds"]), statistics.median(row["seconds"])
        out["methods"][m] = {
            "seconds_min": best, "seconds_median": median, "seconds": row["seconds"],
            "speedup_min": min(stock["seconds"]) / best,
            "forward_tokens": tokens[m], "token_ratio": tokens["stock"] / tokens[m],
            "linear_gflop": flops[m], "flop_ratio": flops["stock"] / flops[m],
            "speedup_median": statistics.median(stock["seconds"]) / median,
            **accuracy(lm_task, instances, row["answers"]),
            "max_abs_loglikelihood_diff": max(abs(a[0] - b[0]) for a, b in zip(row["answers"], stock["answers"])),
            "same_greedy": all(a[1] == b[1] for a, b in zip(row["answers"], stock["answers"])),
            "kept_attention_fraction": row["stats"]["kept_attention_fraction"],
            "prefill_attention_elements": row["stats"]["prefill_attention_elements"],
        }
    return out


def markdown(meta: dict, settings: list[dict]) -> list[str]:
    lines = [f"{meta['model']}, Top-θ post-softmax + VMC. {bench_report.describe(meta)} "
             f"speed-up = stock time / method time (min over {meta['repeats']} repeats; median in brackets); "
             "token ratio = token positions stock runs / positions the method runs; FLOP ratio = linear-layer "
             "multiply-adds stock runs / the method's (stock computes LM-head logits at every position, the "
             "others only where scored): the bound on the speed-up where the linear layers set the cost.", "",
             "| task | method | seconds | speed-up | token ratio | FLOP ratio | acc | acc_norm | max Δ loglik | kept attention |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in settings:
        for m, r in s["methods"].items():
            lines.append(f"| {s['task']} {s['num_fewshot']}-shot, k={s['k']}, {s['documents']} q | {m} | "
                         f"{r['seconds_min']:.1f} | {r['speedup_min']:.2f}× ({r['speedup_median']:.2f}×) | "
                         f"{r['token_ratio']:.2f}× | {r['flop_ratio']:.2f}× | "
                         f"{r['acc']:.3f} | {r['acc_norm']:.3f} | {r['max_abs_loglikelihood_diff']:.1e} | "
                         f"{r['kept_attention_fraction']:.4f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=100, help="questions per task (default 100)")
    p.add_argument("--data-dir", default="auto", help="task data dir (default: auto)")
    p.add_argument("--calib-docs", type=int, default=32, help="train documents for calibration (default 32)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per method (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tasks", nargs="*", default=[t for t, _, _ in SETTINGS], help="subset of arc_easy arc_challenge")
    p.add_argument("--out", default=str(ROOT / "results" / "bench" / "eval"), help="output path without suffix")
    args = p.parse_args(argv)
    if args.limit < 1 or args.repeats < 1 or args.calib_docs < 1:
        p.error("--limit, --repeats and --calib-docs must be >= 1")
    unknown = set(args.tasks) - {t for t, _, _ in SETTINGS}
    if unknown:
        p.error(f"unknown tasks {sorted(unknown)}; choose from {[t for t, _, _ in SETTINGS]}")
    data_dir = resolve_data_dir(args.data_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    from toptheta.models import load_model

    model, tokenizer, info = load_model("smollm2-135m")
    command = bench_report.command_line("bench_eval.py", argv)
    meta = bench_report.machine(model="SmolLM2-135M", repeats=args.repeats)
    settings = [run_setting(model, tokenizer, task, num_fewshot, k, args, data_dir)
                for task, num_fewshot, k in SETTINGS if task in args.tasks]
    bench_report.finish(meta)
    lines = markdown(meta, settings)
    bench_report.write(args.out, command, meta, {"settings": settings}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
