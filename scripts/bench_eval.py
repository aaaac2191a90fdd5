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
train documents of the same task and cached where run.py caches thresholds ($TOPTHETA_CACHE/thresholds/).

With --prefix-cache, the few-shot regime of the paper instead (25 shots; issue 27): ``shared`` (each context once,
as above) against ``prefix`` (SharedContextHFLM's prefix cache: the token prefix that contexts share runs once) on

    arc_easy       25-shot, fixed exemplars (first_n), k = 16
    arc_challenge  25-shot, fixed exemplars (first_n), k = 64
    arc_easy       25-shot, random exemplars per question (lm-eval's default sampler, the paper's protocol), k = 16

with thresholds calibrated on train rows built the same way (25 shots, the same sampler). Stock HFLM is left out
there (about 4× the shared path's time at 25 shots).

Usage:  python scripts/bench_eval.py                                   (100 questions, the shipped data)
        python scripts/bench_eval.py --limit 20 --out results/bench/eval_small
        python scripts/bench_eval.py --prefix-cache                    (writes results/bench/eval_prefix)
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
from toptheta import config  # noqa: E402
from toptheta.spec import RunSpec  # noqa: E402
from toptheta.thresholds_cache import obtain_thresholds, thresholds_claim  # noqa: E402
from toptheta.results import bench_report  # noqa: E402
from toptheta.evaluation.calibration_inputs import build_requests  # noqa: E402
from toptheta.evaluation.task_loading import load_tasks, task_manager  # noqa: E402
from toptheta.evaluation.prefix_cache import prefix_groups  # noqa: E402
from toptheta.evaluation.tasks import check_tasks, resolve_data_dir, task_include_paths  # noqa: E402

SETTINGS = [("arc_easy", 0, 16, None), ("arc_challenge", 5, 64, None)]  # (task, num_fewshot, k, few-shot sampler)
PREFIX_SETTINGS = [("arc_easy", 25, 16, "first_n"), ("arc_challenge", 25, 64, "first_n"), ("arc_easy", 25, 16, None)]
LAYER_K = {0: 512, 1: 512}
METHODS = ("stock", "batched", "shared")
PREFIX_METHODS = ("shared", "prefix")


def build_task(task: str, data_dir, num_fewshot: int, limit: int, seed: int = 1234, sampler: str | None = None):
    """The lm-eval Task with its loglikelihood requests built as simple_evaluate would build them."""
    check_tasks([task], data_dir, num_fewshot)
    with task_include_paths([task], data_dir) as include_paths:
        lm_task = load_tasks(task_manager(include_paths), [task], data_dir, sampler)[task]
        build_requests(lm_task, num_fewshot, limit, seed)
    return lm_task


def thresholds_for(model, tokenizer, task: str, k: int, data_dir, calib_docs: int, num_fewshot: int = 0,
                   sampler: str | None = None) -> toptheta.Thresholds:
    """Top-θ post-softmax thresholds from `calib_docs` train documents of `task`, their rows built as the evaluated
    ones (`num_fewshot` shots drawn by `sampler`): run.py's thresholds cache, keyed as a run with these settings
    (calib=paper's defaults, comp=none) keys them, model fingerprint and calibration settings included."""
    calib = {key: value for key, value in config.defaults(config.CalibConfig).items()
             if key not in ("beyond", "cover_shots")}  # at their defaults: out of the key, as run.py leaves them
    calib.update(task=task, num_samples=calib_docs, num_fewshot=num_fewshot,
                 **({"fewshot_sampler": sampler} if sampler else {}))
    spec = RunSpec.for_thresholds(
        model={"name": "smollm2-135m", "source": "smollm2-135m", "revision": None, "dtype": "float32",
               "max_length": None},
        sparsifier={"name": "toptheta", "k": k, "placement": "post", "layer_k": LAYER_K},
        comp={"sdc": None, "sdc_scale": 1.0, "vmc": False}, calib=calib,
        data_dir_path=str(data_dir) if data_dir else None)
    with thresholds_claim(spec, model):
        thresholds, path = obtain_thresholds(spec, model, tokenizer)
    print(f"thresholds k={k} from {calib_docs} documents of {task} train: {path}", flush=True)
    return thresholds


def lm_for(method: str, model, tokenizer):
    from lm_eval.models.huggingface import HFLM

    from toptheta.evaluation.shared_context_lm import BatchedHFLM, SharedContextHFLM

    if method in ("shared", "prefix"):
        return SharedContextHFLM(pretrained=model, tokenizer=tokenizer, batch_size="auto",
                                 prefix_cache=method == "prefix")
    cls = {"stock": HFLM, "batched": BatchedHFLM}[method]
    return cls(pretrained=model, tokenizer=tokenizer, batch_size=1 if method == "stock" else "auto")


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
    contexts = sorted({tuple(ctx) for ctx, _ in pairs})
    shared = sum(len(ctx) for ctx in contexts) + sum(len(cont) - 1 for _, cont in pairs)
    saved = sum((len(members) - 1) * n for n, members in prefix_groups(contexts))  # the prefix once per group
    return {"stock": per_request, "batched": per_request, "shared": shared, "prefix": shared - saved}


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
    saved = sum((len(members) - 1) * n for n, members in prefix_groups(sorted(contexts)))
    gflop = lambda positions, logits: 2e-9 * (positions * body + logits * head)  # noqa: E731
    return {"stock": gflop(per_request, per_request), "batched": gflop(per_request, scored),
            "shared": gflop(shared_body, shared_head), "prefix": gflop(shared_body - saved, shared_head)}


def run_setting(model, tokenizer, task, num_fewshot, k, sampler, args, data_dir) -> dict:
    methods = PREFIX_METHODS if args.prefix_cache else METHODS
    lm_task = build_task(task, data_dir, num_fewshot, args.limit, sampler=sampler)
    instances = lm_task.instances
    thresholds = thresholds_for(model, tokenizer, task, k, data_dir, args.calib_docs, num_fewshot, sampler)
    lms = {m: lm_for(m, model, tokenizer) for m in methods}
    score(lms["shared"], model, thresholds, instances[:8])  # warm-up: kernels built, caches touched
    rows = {m: {"seconds": []} for m in methods}
    for repeat in range(args.repeats):  # methods interleaved, so a noisy stretch hits all of them
        for m in methods:
            answers, stats, seconds = score(lms[m], model, thresholds, instances)
            rows[m]["seconds"].append(seconds)
            rows[m].update(answers=answers, stats=stats)
            print(f"{task} {num_fewshot}-shot {m}: {seconds:.1f} s", flush=True)
    stock = rows[methods[0]]  # the reference: stock HFLM, or the shared path without the prefix cache
    tokens = forward_tokens(lms[methods[0]], instances)
    flops = linear_flops(lms[methods[0]], instances, model)
    out = {"task": task, "num_fewshot": num_fewshot, "k": k, "sampler": sampler or "default",
           "reference": methods[0], "documents": len({i.doc_id for i in instances}),
           "requests": len(instances), "methods": {}}
    for m, row in rows.items():
        best, median = min(row["seconds"]), statistics.median(row["seconds"])
        out["methods"][m] = {
            "seconds_min": best, "seconds_median": median, "seconds": row["seconds"],
            "speedup_min": min(stock["seconds"]) / best,
            "forward_tokens": tokens[m], "token_ratio": tokens[methods[0]] / tokens[m],
            "linear_gflop": flops[m], "flop_ratio": flops[methods[0]] / flops[m],
            "speedup_median": statistics.median(stock["seconds"]) / median,
            **accuracy(lm_task, instances, row["answers"]),
            "max_abs_loglikelihood_diff": max(abs(a[0] - b[0]) for a, b in zip(row["answers"], stock["answers"])),
            "same_greedy": all(a[1] == b[1] for a, b in zip(row["answers"], stock["answers"])),
            "kept_attention_fraction": row["stats"]["kept_attention_fraction"],
            "prefill_attention_elements": row["stats"]["prefill_attention_elements"],
            "clamped_rows": row["stats"]["clamped_rows"],
        }
    return out


def markdown(meta: dict, settings: list[dict]) -> list[str]:
    reference = settings[0]["reference"] if settings else "stock"
    lines = [f"{meta['model']}, Top-θ post-softmax + VMC. {bench_report.describe(meta)} "
             f"speed-up = {reference} time / method time (min over {meta['repeats']} repeats; median in brackets); "
             f"token ratio = token positions {reference} runs / positions the method runs; FLOP ratio = linear-layer "
             f"multiply-adds {reference} runs / the method's (stock computes LM-head logits at every position, the "
             "others only where scored): the bound on the speed-up where the linear layers set the cost.", "",
             "| task | method | seconds | speed-up | token ratio | FLOP ratio | acc | acc_norm | max Δ loglik | kept attention |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in settings:
        for m, r in s["methods"].items():
            exemplars = {"first_n": ", fixed exemplars", "default": ""}.get(s.get("sampler", "default"), "")
            lines.append(f"| {s['task']} {s['num_fewshot']}-shot{exemplars}, k={s['k']}, {s['documents']} q | {m} | "
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
    p.add_argument("--tasks", nargs="*", default=[t for t, *_ in SETTINGS], help="subset of arc_easy arc_challenge")
    p.add_argument("--prefix-cache", action="store_true",
                   help="25-shot settings: the shared path with and without the prefix cache")
    p.add_argument("--out", default=None, help="output path without suffix (default results/bench/eval, or "
                                               "results/bench/eval_prefix with --prefix-cache)")
    args = p.parse_args(argv)
    args.out = args.out or str(ROOT / "results" / "bench" / ("eval_prefix" if args.prefix_cache else "eval"))
    if args.limit < 1 or args.repeats < 1 or args.calib_docs < 1:
        p.error("--limit, --repeats and --calib-docs must be >= 1")
    unknown = set(args.tasks) - {t for t, *_ in SETTINGS}
    if unknown:
        p.error(f"unknown tasks {sorted(unknown)}; choose from {[t for t, *_ in SETTINGS]}")
    data_dir = resolve_data_dir(args.data_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    from toptheta.models import load_model

    model, tokenizer, info = load_model("smollm2-135m")
    command = bench_report.command_line("bench_eval.py", argv)
    meta = bench_report.machine(model="SmolLM2-135M", repeats=args.repeats)
    settings = [run_setting(model, tokenizer, task, num_fewshot, k, sampler, args, data_dir)
                for task, num_fewshot, k, sampler in (PREFIX_SETTINGS if args.prefix_cache else SETTINGS)
                if task in args.tasks]
    bench_report.finish(meta)
    lines = markdown(meta, settings)
    bench_report.write(args.out, command, meta, {"settings": settings}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
