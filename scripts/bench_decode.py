#!/usr/bin/env python
"""Decode attention benchmark: one query row over a KV cache, transformers' sdpa against our kernel, side by side.

One process, same inputs, methods interleaved repeat by repeat. Per-layer shapes (B=1, float32):

    smollm2-135m   9 query heads, 3 KV heads, head_dim 64
    llama3-8b     32 query heads, 8 KV heads, head_dim 128

for KV lengths --lengths (default 4k, 16k, 64k) and kept V-row fractions --fractions (default 1/3, 1/10: the
union over the query heads of a KV head, what the paper reports for decoding). Methods:

    sdpa                 transformers.integrations.sdpa_attention.sdpa_attention_forward (is_causal=False, no mask)
    ours_dense           toptheta.sparse_attention with Dense() (the fast decode path, every V row read)
    ours_post_vmc        TopTheta(post) + VMC, fast decode path (reads only the kept V rows; running V sum)
    ours_pre_sdc_vmc     TopTheta(pre) + exact SDC + VMC, fast decode path
    plain_post_vmc       TopTheta(post) + VMC through the plain kernel (TOPTHETA_FAST off), up to --plain-max-len

Thresholds: per head, θ is the (1 − f)-quantile of that head's scores (probabilities for post, logits for pre) on
the benchmark's own data, with f = 1 − (1 − u)^(1/G) so that the union over a KV head's G query heads is close to
the target fraction u; the realised union fraction is measured and reported. The running V sum of VMC is warmed by
one call per configuration (as in generation, where each step adds one row), so the timed calls measure steady
decoding.

--e2e (slow) adds end-to-end ``model.generate`` on SmolLM2-135M (the packaged model) with a long prompt: decode
tokens per second of sdpa, our Dense and Top-θ post + VMC (thresholds calibrated on the prompt itself) with the fast
decode on and off; tokens/s = new tokens / (time of generate(N + 1 tokens) − time of generate(1 token)).

Usage:  python scripts/bench_decode.py                  (all shapes, ~10 min on 2 idle cores)
        python scripts/bench_decode.py --quick          (4k and 16k, fewer repeats: a minute or two)
        python scripts/bench_decode.py --e2e            (adds the generate benchmark, several minutes more)
        python scripts/bench_decode.py --step [--profile] (whole decode steps of a one-layer SmolLM2-shaped model at
                                                 16k cached keys, sdpa against Top-θ post + VMC: about a minute;
                                                 results/bench/decode_step.{json,md})
        python scripts/bench_decode.py --device cuda    (sdpa's FlashAttention against our Triton decode kernel,
                                                 LLaMA-3-8B shapes, bf16, 16k and 64k keys: scripts/bench_gpu.py;
                                                 results/bench/gpu_decode.{json,md}; --device cpu-interpret: a dry run
                                                 on CPU in Triton's interpreter, tiny shapes)
Outputs: results/bench/decode.{json,md} (the command on the first line of each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if "cpu-interpret" in sys.argv:  # before anything imports triton: its kernels then run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench_gpu, bench_decode_step

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import toptheta  # noqa: E402
from toptheta.attention import decode, prefill  # noqa: E402
from toptheta.thresholds import Thresholds  # noqa: E402
from toptheta.results import bench_report  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
METHODS = ("sdpa", "ours_dense", "ours_post_vmc", "ours_pre_sdc_vmc", "plain_post_vmc")


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, False


def thresholds_for(q, k, union: float, placement: str) -> Thresholds:
    """θ per head at the (1 − f) quantile of its scores, f chosen so the union over G heads is ≈ ``union``."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    G = H // Hkv
    s = torch.einsum("hd,hkd->hk", q[0, :, 0], k[0].repeat_interleave(G, 0)) * D ** -0.5  # (H, K)
    x = s if placement == "pre" else torch.softmax(s, -1)
    f = 1 - (1 - union) ** (1 / G)
    theta = torch.quantile(x, 1 - f, dim=-1)  # (H,)
    return Thresholds(theta.view(1, H, 1), [64], placement)


def realised_union(q, k, v, sparsifier) -> float:
    seen = []
    toptheta.sparse_attention(q, k, v, None, scaling=q.shape[-1] ** -0.5, layer=0, sparsifier=sparsifier,
                              observer=lambda rows: seen.append(rows.keep))
    H, Hkv, K = q.shape[1], k.shape[1], k.shape[2]
    return float(seen[0].view(1, Hkv, H // Hkv, K).any(2).float().mean())


def make_calls(q, k, v, post: Thresholds, pre: Thresholds) -> dict:
    scaling, G = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
    module = _Module(G)

    def ours(sparsifier, comp, fast=True):
        def call():
            decode.ENABLED = fast
            try:
                return toptheta.sparse_attention(q, k, v, None, scaling=scaling, layer=0, sparsifier=sparsifier,
                                                 compensations=comp)
            finally:
                decode.ENABLED = True
        return call

    vmc = [toptheta.VMC()]
    return {
        "sdpa": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=scaling, is_causal=False)[0],
        "ours_dense": ours(toptheta.Dense(), []),
        "ours_post_vmc": ours(toptheta.TopTheta(post), vmc),
        "ours_pre_sdc_vmc": ours(toptheta.TopTheta(pre), [toptheta.SDC("exact"), *vmc]),
        "plain_post_vmc": ours(toptheta.TopTheta(post), vmc, fast=False),
    }


def time_calls(calls: dict, repeats: int) -> dict:
    for call in calls.values():  # warm-up (and the running V sums)
        call()
    wall = {m: [] for m in calls}
    cpu = {m: [] for m in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            c0, t0 = time.process_time(), time.perf_counter()
            call()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return {m: {"time_s": statistics.median(wall[m]), "time_min_s": min(wall[m]), "cpu_min_s": min(cpu[m]),
                "times_s": wall[m]} for m in calls}


def bench_attention(args) -> list[dict]:
    rows = []
    for shape in args.shapes:
        H, Hkv, D = SHAPES[shape]
        for K in args.lengths:
            g = torch.Generator().manual_seed(args.seed)
            q = torch.randn(1, H, 1, D, generator=g)
            k = torch.randn(1, Hkv, K, D, generator=g)
            v = torch.randn(1, Hkv, K, D, generator=g)
            ref = make_calls(q, k, v, *(thresholds_for(q, k, 0.5, p) for p in ("post", "pre")))["sdpa"]()
            for u in args.fractions:
                post, pre = thresholds_for(q, k, u, "post"), thresholds_for(q, k, u, "pre")
                calls = make_calls(q, k, v, post, pre)
                if K > args.plain_max_len:
                    calls.pop("plain_post_vmc")
                calls = {m: c for m, c in calls.items() if m in args.methods}
                dense_err = float((calls["ours_dense"]() - ref).abs().max()) if "ours_dense" in calls else None
                timing = time_calls(calls, args.repeats)
                base = timing.get("sdpa")
                union = {"post": realised_union(q, k, v, toptheta.TopTheta(post)),
                         "pre": realised_union(q, k, v, toptheta.TopTheta(pre))}
                for name, t in timing.items():
                    rows.append({
                        "shape": shape, "kv_len": K, "target_vrow_fraction": u,
                        "vrow_fraction": union["pre" if "pre" in name else "post"] if "dense" not in name
                        and name != "sdpa" else 1.0,
                        "method": name, **t,
                        "time_ratio": t["time_s"] / base["time_s"] if base else None,
                        "min_ratio": t["time_min_s"] / base["time_min_s"] if base else None,
                        "cpu_ratio": t["cpu_min_s"] / base["cpu_min_s"] if base else None,
                        "dense_vs_sdpa_max_abs": dense_err,
                    })
                    print(f"{shape} K={K} u={u:.3f} {name:17s} {t['time_s'] * 1e3:9.3f} ms median "
                          f"{t['time_min_s'] * 1e3:9.3f} ms min  ({rows[-1]['time_ratio']:.2f}x sdpa)", flush=True)
                del calls
            del q, k, v
    return rows


def bench_generate(args) -> list[dict]:
    """Decode tokens/s of model.generate on SmolLM2-135M with a long prompt."""
    from toptheta.attention.cache import growing_cache
    from toptheta.models import load_model

    model, tokenizer, _ = load_model("smollm2-135m")
    text = (ROOT / "README.md").read_text() + "\n" + (ROOT / "toptheta" / "attention" / "kernel.py").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids
    while ids.shape[1] < args.e2e_prompt:
        ids = torch.cat([ids, ids], 1)
    ids = ids[:, :args.e2e_prompt]
    t0 = time.perf_counter()
    thresholds = toptheta.calibrate(model, [ids], k=64, placement="post", layer_k={0: 512, 1: 512},
                                    sample_frac=0.25, progress=False)
    print(f"calibrated Top-θ (k=64, post) on the prompt in {time.perf_counter() - t0:.0f}s", flush=True)

    from transformers import LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        """Timestamps each generation step (called once per new token, after its forward)."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(cache: str) -> tuple[float, float]:
        """(prompt seconds, decode tokens/s) of one generate call: the first step is the prompt's forward, the
        others are decode steps, so prefill noise never leaks into the decode rate."""
        clock, t = Clock(), time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.e2e_new_tokens + 1,
                           min_new_tokens=args.e2e_new_tokens + 1, do_sample=False,
                           pad_token_id=tokenizer.eos_token_id, logits_processor=LogitsProcessorList([clock]),
                           cache=growing_cache(model) if cache == "growing" else None)
        steps = clock.times
        return steps[0] - t, (len(steps) - 1) / (steps[-1] - steps[0])

    # (name, cache, config): transformers' DynamicCache re-concatenates every layer's K and V at each token;
    # cache.GrowingLayer writes into spare room. The first row is the baseline of the ×sdpa column.
    configs = [("sdpa", "dynamic", None), ("sdpa", "growing", None),
               ("ours_dense", "growing", (toptheta.Dense(), [], True)),
               ("ours_post_vmc", "growing", (toptheta.TopTheta(thresholds), [toptheta.VMC()], True)),
               ("ours_post_vmc", "dynamic", (toptheta.TopTheta(thresholds), [toptheta.VMC()], True)),
               ("plain_post_vmc", "growing", (toptheta.TopTheta(thresholds), [toptheta.VMC()], False))]
    rows = []
    for name, cache, config in configs:
        stats = None
        if config is None:
            prompt_s, tps = generate(cache)
        else:
            sparsifier, comp, fast = config
            decode.ENABLED = prefill.ENABLED = fast
            try:
                with toptheta.sparsify(model, sparsifier, comp) as stats:
                    prompt_s, tps = generate(cache)
            finally:
                decode.ENABLED = prefill.ENABLED = True
        rows.append({"method": name, "cache": cache, "prompt_tokens": ids.shape[1], "new_tokens": args.e2e_new_tokens,
                     "prompt_s": prompt_s, "decode_tokens_per_s": tps,
                     "kept_vrow_fraction": stats.kept_vrow_fraction if stats is not None else None})
        print(f"generate {name:15s} {cache:8s} prompt {prompt_s:7.2f}s  decode {tps:7.2f} tokens/s", flush=True)
    base = rows[0]["decode_tokens_per_s"]
    for row in rows:
        row["speed_vs_sdpa"] = row["decode_tokens_per_s"] / base
    return rows




def write_report(args, command: str, rows: list[dict], e2e: list[dict], meta: dict) -> None:
    lines = ["# Decode attention benchmark", "",
             f"{bench_report.describe(meta)} Ratios are to sdpa of the same statistic, measured in this process."]
    if rows:
        lines += ["", "| shape | KV len | V rows kept | method | median ms | ×sdpa | min ms | ×sdpa (min) | cpu ×sdpa |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['kv_len']} | {r['vrow_fraction']:.3f} | {r['method']} | "
                     f"{r['time_s'] * 1e3:.3f} | {r['time_ratio']:.2f} | {r['time_min_s'] * 1e3:.3f} | "
                     f"{r['min_ratio']:.2f} | {r['cpu_ratio']:.2f} |")
    if e2e:
        lines += ["", "## generate, SmolLM2-135M (decode rate from per-step timestamps: the prompt's forward excluded)", "",
                  "| method | KV cache | prompt tokens | new tokens | prompt s | decode tokens/s | ×sdpa | kept V rows |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in e2e:
            kept = "" if r["kept_vrow_fraction"] is None else f"{r['kept_vrow_fraction']:.3f}"
            lines.append(f"| {r['method']} | {r.get('cache', 'dynamic')} | {r['prompt_tokens']} | {r['new_tokens']} | {r['prompt_s']:.2f} | "
                         f"{r['decode_tokens_per_s']:.2f} | {r['speed_vs_sdpa']:.2f} | {kept} |")
    lines += ["", "Target (issue 9): ≥ 1.5× faster than sdpa at 16k with 1/10 of the V rows kept (time ratio ≤ 0.67).",
              "Thresholds: per-head quantiles of the benchmark's own scores, aimed at the target union fraction; "
              "the realised fraction is in the table."]
    bench_report.write(args.out, command, meta, {"attention": rows, "generate": e2e}, lines)


def step_report(args, command: str) -> int:
    """--step: whole decode steps, sdpa against Top-θ post + VMC (bench_decode_step.py); writes OUT.{json,md}."""
    import bench_decode_step

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    out = args.out if args.out != "results/bench/decode" else "results/bench/decode_step"
    meta = bench_report.machine(model="one-layer SmolLM2-135M-shaped Llama, vocabulary 1024", dtype="float32", batch=1)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), load {meta['load_start']}", flush=True)
    result = bench_decode_step.run_step(args.step_len, args.step_fraction, args.step_steps, seed=args.seed)
    profile = bench_decode_step.profile_step(args.step_len, args.step_fraction, seed=args.seed) if args.profile else None
    bench_report.finish(meta)
    s, o = result["methods"]["sdpa"], result["methods"]["ours_post_vmc"]
    print(f"step at {args.step_len} keys: sdpa {s['time_s'] * 1e3:.3f} ms, ours {o['time_s'] * 1e3:.3f} ms median: "
          f"{result['speedup']:.2f}x faster (min: {result['speedup_min']:.2f}x, CPU time: {result['speedup_cpu']:.2f}x); V rows kept "
          f"{result['vrow_fraction']:.3f}", flush=True)
    lines = ["# Whole decode steps: sdpa against Top-θ post + VMC", "",
             f"{bench_report.describe(meta)} A one-layer Llama with SmolLM2-135M's attention and MLP shapes (9 heads, 3 KV "
             "heads, head_dim 64, hidden 576, MLP 1536; vocabulary 1024), float32, two copies of it each with a "
             f"`growing_cache` filled by the same sdpa prefill of {args.step_len} random tokens, then "
             f"{result['steps']} timed decode steps of the same tokens, alternating step by step (after 3 warm-up steps).",
             "", "| method | median ms | min ms | CPU ms (median) | speed ×sdpa (median) | speed ×sdpa (min) | "
             "speed ×sdpa (CPU time) | V rows kept | backend |", "|---|---:|---:|---:|---:|---:|---:|---:|---|",
             f"| sdpa | {s['time_s'] * 1e3:.3f} | {s['time_min_s'] * 1e3:.3f} | {s['cpu_s'] * 1e3:.3f} | 1.00 | 1.00 | 1.00 | "
             "1.000 | sdpa |",
             f"| ours_post_vmc | {o['time_s'] * 1e3:.3f} | {o['time_min_s'] * 1e3:.3f} | {o['cpu_s'] * 1e3:.3f} | "
             f"{result['speedup']:.2f} | {result['speedup_min']:.2f} | {result['speedup_cpu']:.2f} | "
             f"{result['vrow_fraction']:.3f} | {', '.join(result['backend_calls'])} |",
             "", "Target (issue 29): ≥ 1.3× faster than sdpa per model step at 16k cached keys and 1/10 of the V rows.",
             f"Largest |logit difference| to sdpa over the steps (Top-θ drops mass, VMC puts back its mean): "
             f"{result['logits_max_abs_diff']:.3g}."]
    if profile:
        lines += ["", "## cProfile of our decode steps (own time)", "", "```", *profile.strip().splitlines()[:40], "```"]
    bench_report.write(out, command, meta, {"step": result, "profile": profile}, lines)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="KV lengths (default 4096 16384 65536 on the CPU; 16384 65536 with --device cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "cpu-interpret"],
                   help="cuda: sdpa's FlashAttention against our Triton decode kernel, LLaMA-3-8B shapes, bf16 "
                        "(scripts/bench_gpu.py); cpu-interpret: the same code on CPU in Triton's interpreter, tiny shapes")
    p.add_argument("--step", action="store_true", help="time whole decode steps of a one-layer SmolLM2-shaped model, "
                   "sdpa against Top-θ post + VMC, same growing cache (scripts/bench_decode_step.py)")
    p.add_argument("--step-len", type=int, default=16384, help="cached keys for --step")
    p.add_argument("--step-fraction", type=float, default=0.1, help="kept V-row fraction aimed at by --step")
    p.add_argument("--step-steps", type=int, default=40, help="timed decode steps for --step")
    p.add_argument("--profile", action="store_true", help="with --step: also a cProfile table of our steps")
    p.add_argument("--fractions", type=float, nargs="+", default=[1 / 3, 1 / 10])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--plain-max-len", type=int, default=16384, help="run the plain kernel only up to this KV length")
    p.add_argument("--quick", action="store_true", help="4k and 16k, 3 repeats (a check that everything runs)")
    p.add_argument("--e2e", action="store_true", help="also time model.generate on SmolLM2-135M (slow)")
    p.add_argument("--e2e-prompt", type=int, default=8192 - 64, help="prompt tokens for --e2e")
    p.add_argument("--e2e-new-tokens", type=int, default=32)
    p.add_argument("--e2e-only", action="store_true", help="only the generate benchmark (implies --e2e; use another "
                   "--out, e.g. results/bench/decode_generate)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU count)")
    p.add_argument("--out", default="results/bench/decode", help="output stem: writes STEM.json and STEM.md")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    command = bench_report.command_line("bench_decode.py", argv)
    if args.device != "cpu":
        import bench_gpu

        out = args.out if args.out != "results/bench/decode" else "results/bench/gpu_decode"
        bench_gpu.run("decode", args.device, args.lengths, args.fractions, args.repeats, out, command, seed=args.seed)
        return 0
    if args.step:
        return step_report(args, command)
    args.lengths = args.lengths or [4096, 16384, 65536]
    if args.quick:
        args.lengths = [n for n in args.lengths if n <= 16384] or [4096]
        args.repeats = min(args.repeats, 3)
    if "sdpa" not in args.methods:
        p.error("--methods must include sdpa: every ratio is to sdpa")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    meta = bench_report.machine(shapes={s: dict(zip(("heads", "kv_heads", "head_dim"), SHAPES[s])) for s in args.shapes},
                                dtype="float32", batch=1)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), load {meta['load_start']}", flush=True)
    rows = [] if args.e2e_only else bench_attention(args)
    e2e = bench_generate(args) if args.e2e or args.e2e_only else []
    bench_report.finish(meta)
    write_report(args, command, rows, e2e, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
