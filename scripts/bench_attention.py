#!/usr/bin/env python
"""Prefill attention benchmark: transformers' sdpa and eager attention against our kernel, side by side.

One process, same inputs, same conditions. Shapes are SmolLM2-135M's attention (B=1, 9 query heads,
3 KV heads, head_dim 64, float32) for a causal prefill of n tokens, n in --sizes. Methods:

    sdpa        transformers.integrations.sdpa_attention.sdpa_attention_forward (attention_mask=None,
                is_causal=True: torch's fused CPU flash kernel, GQA without repeating K/V)
    eager       transformers.models.llama.modeling_llama.eager_attention_forward with the additive causal
                mask (skipped where its estimated memory 3·B·H·n²·4 bytes exceeds --eager-budget-gb)
    ours_dense  toptheta.sparse_attention with Dense()
    ours_topk   TopK(k=64, placement="post"), no compensation (the fused kernel's linear-time selection)
    plain_topk  the same through the torch path (torch.topk, the fused extension off), for the fused path's gain
    ours_topp   TopP(p=0.9, placement="post") + VMC, the top-p baseline (the fused kernel's selection, no sort)
    plain_topp  the same through the torch path (a sort per row), for the fused path's gain
    ours_skip   SkipSoftmax(lam=1, placement="post") + VMC, BLASST's rule after the softmax (the one-pass prefill's
                two passes, attention/prefill.py)
    select_skip the same through the plain kernel with its fused post-softmax selection (cpu-select)
    plain_skip  the same through the torch path (both compiled kernels off)
    ours_skip_pre   SkipSoftmax(lam=1, placement="pre"), no compensation: BLASST as deployed (the one-pass prefill)
    plain_skip_pre  the same through the plain kernel (the torch path: the selection kernel has no pre-softmax rule)
    ours_toptheta  TopTheta(post) + VMC, k=[64]; thresholds calibrated on the benchmark's own data (below)
    ours_pre_sdc_vmc   TopTheta(pre) + exact SDC + VMC (the paper's pre-softmax variant; the one-pass prefill,
                   attention/prefill.py), logit thresholds calibrated the same way
    plain_pre_sdc_vmc  the same through the plain kernel (TOPTHETA_FAST off), for the one-pass path's gain

Timing: the median and the min wall time (and process CPU time) of --repeats calls (methods interleaved,
repeat by repeat); ratios are to sdpa's value of the same statistic.
Memory: before each call gc.collect() and glibc malloc_trim(0); a background thread samples the process
RSS (psutil) every ~1 ms during the call; peak_extra = peak RSS − RSS just before the call (the output
tensor counts: it is allocated by the call). The reported value is the max over the repeats. As a
cross-check, one extra call per (n, method) runs under torch.profiler(profile_memory=True) and the peak
of the running sum of its allocation events (in time order) is reported as prof_peak_MB (sizes up to
--profile-max-n; eager only up to 2048). The two can differ: RSS also holds memory that glibc keeps in its
heap after a tensor is freed (fragmentation across the kernel's chunks); the profiler counts live tensors.
On a shared machine the min wall time over the repeats is the better estimate of the uncontended cost.

Thresholds: the inputs are standard-normal q, k, v (logits ~ N(0, 1) after the 1/√64 scale). For a
sample of query rows spread log-uniformly over row lengths 65..max n, the exact (k+1)-th largest dense
probability of each head is measured on the 32k-token data (whose prefixes are the smaller sizes), and
stored as a (1 layer, 9 heads, n) Thresholds table (the (k+1)-th largest logit for the pre-softmax rows) with linear interpolation between the sampled
lengths. A strict threshold at the (k+1)-th largest keeps k elements per row on average; the realised
mean kept per row is printed for the sizes where correctness is checked.

Short prompts (64 and 256 tokens) show the per-call overhead; rows there are all ≤ k = 64 long at n = 64 (dense).

Usage:  python scripts/bench_attention.py                       (full run, ~10 min on 2 idle cores)
        python scripts/bench_attention.py --quick               (64, 256 and 2048 tokens, few repeats: a check)
        python scripts/bench_attention.py --sizes 512 2048 --out results/bench/attention_small
        python scripts/bench_attention.py --device cuda   (FlashAttention against our Triton prefill kernels, LLaMA-3-8B
                                                 shapes, bf16, 4k/16k/32k: scripts/bench_gpu.py, results/bench/gpu_attention;
                                                 --device cpu-interpret: a dry run in Triton's interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
if "cpu-interpret" in sys.argv:  # before anything imports triton: its kernels then run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.models.llama.modeling_llama import eager_attention_forward  # noqa: E402

import toptheta  # noqa: E402
from toptheta.atomic import write_text_atomic  # noqa: E402
from toptheta.attention import kernel as kernel_module  # noqa: E402
from toptheta.attention import fused, prefill  # noqa: E402
from toptheta.thresholds import Thresholds  # noqa: E402

B, H, HKV, D = 1, 9, 3, 64  # SmolLM2-135M attention
K_BUDGET = 64
SCALING = D ** -0.5
METHODS = ("sdpa", "eager", "ours_dense", "ours_topk", "plain_topk", "ours_topp", "plain_topp", "ours_skip",
           "select_skip", "plain_skip", "ours_skip_pre", "plain_skip_pre", "ours_toptheta", "ours_pre_sdc_vmc",
           "plain_pre_sdc_vmc")
TOP_P = 0.9
DEFAULT_REPEATS = {64: 20, 256: 10, 512: 5, 2048: 5, 8192: 3, 32768: 1}
MB = 1024 * 1024

_LIBC = None


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so RSS before a call is not inflated by free pages."""
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Context manager: peak process RSS above the RSS at entry, sampled by a thread every ``interval`` s."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.proc = psutil.Process()
        self.peak_extra = 0
        self.samples = 0

    def _poll(self):
        while not self._stop.is_set():
            rss = self.proc.memory_info().rss
            if rss > self._peak:
                self._peak = rss
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self):
        gc.collect()
        malloc_trim()
        self.base = self._peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self.proc.memory_info().rss)
        self.peak_extra = self._peak - self.base
        return False


def profiled_peak_bytes(fn) -> int:
    """Peak of the running sum of allocation events recorded by torch.profiler during ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = []

    def walk(nodes):
        for node in nodes:
            size = getattr(node.extra_fields, "alloc_size", None)
            if size is not None and "Allocation" in str(node.tag):
                events.append((node.start_time_ns, int(size)))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    events.sort()
    running = peak = 0
    for _, size in events:
        running += size
        peak = max(peak, running)
    return peak


class _Module(torch.nn.Module):
    """What transformers' attention functions read off the attention module."""

    def __init__(self):
        super().__init__()
        self.num_key_value_groups = H // HKV
        self.is_causal = True
        self.eval()


def calibrate_thresholds(q: torch.Tensor, k: torch.Tensor, n_max: int, samples: int, seed: int = 0,
                         placement: str = "post") -> Thresholds:
    """θ(head, n) = the (k+1)-th largest dense probability (logit for pre) of sampled rows, linear in n."""
    lengths = torch.unique(torch.logspace(math.log10(K_BUDGET + 1), math.log10(n_max), samples).round().long())
    values = torch.full((1, H, n_max + 1), float("nan"))
    kv_of_head = torch.arange(H) // (H // HKV)
    for n in lengths.tolist():
        qi = q[0, :, n - 1]  # (H, D): the query of the row with n valid keys
        logits = torch.einsum("hd,hnd->hn", qi, k[0, kv_of_head, :n]) * SCALING
        scores = logits if placement == "pre" else torch.softmax(logits, dim=-1)
        values[0, :, n] = torch.topk(scores, K_BUDGET + 1, dim=-1).values[:, -1]
    meta = {"source": "bench_attention.py synthetic calibration", "sampled_lengths": len(lengths)}
    return Thresholds(values, [K_BUDGET], placement, metadata=meta, lookup="linear")


def load_kernel(path: str | None, name: str = "_bench_kernel"):
    """The kernel module: the package's, or another copy of kernel.py (e.g. an older version, for before/after)."""
    if not path:
        return kernel_module
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"toptheta.attention.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rows_per_chunk(kernel, n: int, chunk_size: int | None) -> int:
    if chunk_size:
        return chunk_size
    if hasattr(kernel, "default_rows_per_chunk"):
        return kernel.default_rows_per_chunk(B * H * n)
    return max(1, kernel.DEFAULT_CHUNK_ELEMENTS // (B * H * n))


def make_calls(q, k, v, mask, thresholds, chunk_size, attention=toptheta.sparse_attention, pre_thresholds=None):
    module = _Module()
    # One sparsifier per method for all calls, as in a sparsify session (the kernel memoises θ per sparsifier).
    post = toptheta.TopTheta(thresholds)
    pre = toptheta.TopTheta(pre_thresholds) if pre_thresholds is not None else None
    pre_comp = [toptheta.SDC("exact"), toptheta.VMC()]

    def plain(*a, **kw):  # the plain kernel: the fast paths switched off for this call
        prefill.ENABLED = False
        try:
            return attention(*a, **kw)
        finally:
            prefill.ENABLED = True
    def torch_path(*a, **kw):  # the fused CPU extension switched off for this call
        extension = fused.extension
        fused.extension = lambda: None
        try:
            return attention(*a, **kw)
        finally:
            fused.extension = extension

    def plain_torch(*a, **kw):  # both compiled prefill paths off: the plain kernel's torch ops
        prefill.ENABLED = False
        try:
            return torch_path(*a, **kw)
        finally:
            prefill.ENABLED = True
    calls = {
        "sdpa": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=SCALING, is_causal=True)[0],
        "eager": lambda: eager_attention_forward(module, q, k, v, mask, scaling=SCALING)[0],
        "ours_dense": lambda: attention(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.Dense(), chunk_size=chunk_size),
        "ours_topk": lambda: attention(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.TopK(K_BUDGET, "post"),
            chunk_size=chunk_size),
        "plain_topk": lambda: torch_path(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.TopK(K_BUDGET, "post"),
            chunk_size=chunk_size),
        "ours_topp": lambda: attention(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.TopP(TOP_P, "post"),
            compensations=[toptheta.VMC()], chunk_size=chunk_size),
        "plain_topp": lambda: torch_path(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.TopP(TOP_P, "post"),
            compensations=[toptheta.VMC()], chunk_size=chunk_size),
        "ours_skip": lambda: attention(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.SkipSoftmax(1.0, "post"),
            compensations=[toptheta.VMC()], chunk_size=chunk_size),
        "select_skip": lambda: plain(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.SkipSoftmax(1.0, "post"),
            compensations=[toptheta.VMC()], chunk_size=chunk_size),
        "plain_skip": lambda: plain_torch(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.SkipSoftmax(1.0, "post"),
            compensations=[toptheta.VMC()], chunk_size=chunk_size),
        "ours_skip_pre": lambda: attention(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.SkipSoftmax(1.0, "pre"),
            chunk_size=chunk_size),
        "plain_skip_pre": lambda: plain(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.SkipSoftmax(1.0, "pre"),
            chunk_size=chunk_size),
        "ours_toptheta": lambda: attention(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=post, compensations=[toptheta.VMC()],
            chunk_size=chunk_size),
        "ours_pre_sdc_vmc": lambda: attention(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=pre, compensations=pre_comp, chunk_size=chunk_size),
        "plain_pre_sdc_vmc": lambda: plain(
            q, k, v, None, scaling=SCALING, layer=0, sparsifier=pre, compensations=pre_comp, chunk_size=chunk_size),
    }
    return calls


def eager_mask(n: int) -> torch.Tensor:
    """The additive causal mask transformers' eager path receives: 0 on and below the diagonal, min above."""
    mask = torch.full((n, n), torch.finfo(torch.float32).min)
    return mask.triu_(1)[None, None]


def kept_per_row(q, k, v, thresholds, chunk_size, attention=toptheta.sparse_attention) -> float:
    """Mean number of kept keys per (head, row) over rows longer than k, for top-θ (an untimed pass)."""
    total, rows = [0], [0]

    def observer(block):
        long = (block.n > K_BUDGET).expand(block.keep.shape[:-1])  # (B, H, Qc)
        total[0] += int(block.keep.sum(-1)[long].sum())
        rows[0] += int(long.sum())

    attention(q, k, v, None, scaling=SCALING, layer=0, sparsifier=toptheta.TopTheta(thresholds),
                              compensations=[toptheta.VMC()], observer=observer, chunk_size=chunk_size)
    return total[0] / max(1, rows[0])




def markdown_table(rows: list[dict]) -> str:
    head = ("| n | method | time_s (median) | time/sdpa | time_min_s | min/sdpa | cpu_min_s | cpu/sdpa | "
            "peak_extra_MB (RSS) | mem/sdpa | prof_peak_MB | prof/sdpa | repeats |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['n']} | {r['method']} | skipped: {r['skipped']} |" + " |" * 11)
            continue
        fmt = lambda x, spec: "" if x is None else format(x, spec)  # noqa: E731
        lines.append(f"| {r['n']} | {r['method']} | {r['time_s']:.4f} | {fmt(r['time_ratio'], '.2f')} | "
                     f"{r['time_min_s']:.4f} | {fmt(r['time_min_ratio'], '.2f')} | "
                     f"{r['cpu_min_s']:.4f} | {fmt(r['cpu_min_ratio'], '.2f')} | {r['peak_extra_MB']:.1f} | "
                     f"{fmt(r['mem_ratio'], '.2f')} | {fmt(r['prof_peak_MB'], '.1f')} | {fmt(r['prof_ratio'], '.2f')} | "
                     f"{r['repeats']} |")
    return head + "\n".join(lines) + "\n"


def write_report(args, results, checks, meta_base, thresholds, final: bool) -> None:
    """Write STEM.json and STEM.md (atomically); called after every size, so an interrupted run keeps its rows."""
    cpus = meta_base["cpu_count"]
    table = markdown_table(results)
    meta = {
        **meta_base,
        "complete": final,
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
        "shapes": {"B": B, "H": H, "H_kv": HKV, "head_dim": D, "dtype": "float32", "causal_prefill": True},
        "k": K_BUDGET,
        "thresholds": "post-softmax θ(head, n): exact (k+1)-th largest dense probability of "
                      f"{thresholds.metadata['sampled_lengths']} sampled rows of the benchmark data, linear in n",
        "memory_method": "peak RSS (psutil, ~1 ms polling thread) minus RSS before the call, after gc.collect() "
                         "and malloc_trim(0); max over repeats. prof_peak_MB: torch.profiler allocation events.",
        "time_method": "median and min wall time of the repeats (methods interleaved); on a shared machine the "
                       "min is the better estimate of the uncontended cost",
        "load_average_end": list(os.getloadavg()),
        "cpu_time_note": "cpu_s = process CPU time (all threads) of the call: less sensitive than wall time "
                         "to other processes on the machine",
    }
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    body = json.dumps({"meta": meta, "checks": checks, "results": results}, indent=2)
    write_text_atomic(out.with_suffix(".json"), '{"command": ' + json.dumps(meta["command"]) + ",\n" + body[2:] + "\n")
    header = (f"Command: `{meta['command']}`\n\n# Prefill attention benchmark\n\nSmolLM2-135M attention shapes (B=1, 9 heads, 3 KV heads, d=64, "
              f"float32, causal). {cpus} CPUs, torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{meta['date']}, load average {meta['load_average_start']} at start.\n\n"
              f"Kernel: `{meta['kernel_file']}` (sha1 {meta['kernel_sha1'][:12]}), query rows per chunk: "
              + ", ".join(f"n={r['n']}: {r['rows_per_chunk']}" for r in results if r.get("method") == "ours_dense"
                          and "rows_per_chunk" in r) + "\n\n"
              + ("" if final else "**Partial: written while the run was still going.**\n\n"))
    checks_md = "".join(f"- n={n}: " + ", ".join(f"{key} = {val:.3g}" for key, val in c.items()) + "\n"
                        for n, c in checks.items())
    write_text_atomic(out.with_suffix(".md"), header + table + ("\nChecks:\n" + checks_md if checks_md else "") +
                 f"\nMethods: {meta['time_method']}; memory: {meta['memory_method']}\nThresholds: {meta['thresholds']}.\n")
    if final:
        print()
        print(table)
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def parse_repeats(spec: str | None) -> dict[int, int]:
    repeats = dict(DEFAULT_REPEATS)
    for item in (spec or "").split(","):
        if item.strip():
            n, r = item.split(":")
            repeats[int(n)] = int(r)
    return repeats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="prefill lengths (default 64 … 32768 on the CPU; 4096 16384 32768 with --device cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "cpu-interpret"],
                   help="cuda: FlashAttention against our Triton kernels, LLaMA-3-8B shapes, bf16 (scripts/bench_gpu.py); "
                        "cpu-interpret: the same code on CPU in Triton's interpreter, tiny shapes (a dry run)")
    p.add_argument("--fractions", type=float, nargs="+", default=[1 / 3, 1 / 10], help="kept fractions (--device cuda)")
    p.add_argument("--quick", action="store_true", help="sizes 64, 256, 2048; 3 repeats; no profiler (a check)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", default=None, help="per-size repeats, e.g. '512:5,2048:5,8192:3,32768:1'")
    p.add_argument("--eager-budget-gb", type=float, default=None,
                   help="skip eager where 3·B·H·n²·4 bytes exceeds this (default: half the available RAM)")
    p.add_argument("--chunk-elements", type=int, default=None,
                   help="our kernel's score elements per chunk (default: the kernel's DEFAULT_CHUNK_ELEMENTS)")
    p.add_argument("--profile-max-n", type=int, default=32768, help="profiler cross-check up to this n (0 = off; "
                   "eager only up to 2048, its memory is plain)")
    p.add_argument("--kernel-file", default=None,
                   help="benchmark this copy of toptheta/attention/kernel.py instead of the package's")
    p.add_argument("--compare-kernel", default=None,
                   help="also run the ours_* methods with this other kernel.py (e.g. `git show "
                        "HEAD:toptheta/attention/kernel.py > /tmp/kernel_before.py`), as before_* rows")
    p.add_argument("--calibration-rows", type=int, default=400)
    p.add_argument("--check-sizes", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the CPU count)")
    p.add_argument("--out", default="results/bench/attention", help="output stem: writes STEM.json and STEM.md")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device != "cpu":
        sys.path.insert(0, str(ROOT / "scripts"))
        import bench_gpu
        from toptheta.results import bench_report

        out = args.out if args.out != "results/bench/attention" else "results/bench/gpu_attention"
        repeats = int(args.repeats) if args.repeats and args.repeats.isdigit() else 5
        bench_gpu.run("prefill", args.device, args.sizes, args.fractions, repeats, out,
                      bench_report.command_line("bench_attention.py", argv), seed=args.seed)
        return 0
    args.sizes = args.sizes or [64, 256, 512, 2048, 8192, 32768]
    if args.quick:
        args.sizes = [n for n in args.sizes if n <= 2048] or [64]
        args.repeats = ",".join(f"{n}:3" for n in args.sizes)
        args.profile_max_n = 0

    cpus = os.cpu_count() or 1
    load_start = list(os.getloadavg())
    import hashlib
    kernel = load_kernel(args.kernel_file)
    kernel_sha1 = hashlib.sha1(Path(kernel.__file__).read_bytes()).hexdigest()
    compare = load_kernel(args.compare_kernel, "_bench_compare") if args.compare_kernel else None
    torch.set_num_threads(args.threads or cpus)
    repeats = parse_repeats(args.repeats)
    available = psutil.virtual_memory().available
    eager_budget = args.eager_budget_gb * 1e9 if args.eager_budget_gb else available / 2
    chunk_elements = args.chunk_elements or kernel.DEFAULT_CHUNK_ELEMENTS
    sizes = sorted(args.sizes)
    n_max = max(sizes)
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"{cpus} CPUs, {available / 1e9:.1f} GB available; chunk elements {chunk_elements}; load {load_start}",
          flush=True)

    g = torch.Generator().manual_seed(args.seed)
    q_all = torch.randn(B, H, n_max, D, generator=g)
    k_all = torch.randn(B, HKV, n_max, D, generator=g)
    v_all = torch.randn(B, HKV, n_max, D, generator=g)
    t0 = time.perf_counter()
    thresholds = calibrate_thresholds(q_all, k_all, n_max, args.calibration_rows)
    pre_thresholds = calibrate_thresholds(q_all, k_all, n_max, args.calibration_rows, placement="pre")
    thresholds.table("values", torch.device("cpu"))  # build the lookup tables outside the timed calls
    pre_thresholds.table("values", torch.device("cpu"))
    print(f"calibrated θ on {thresholds.metadata['sampled_lengths']} row lengths in {time.perf_counter() - t0:.1f}s",
          flush=True)

    results, checks = [], {}
    meta_base = {"cpu_count": cpus, "chunk_elements": chunk_elements, "eager_budget_GB": eager_budget / 1e9,
                 "load_average_start": load_start, "kernel_file": kernel.__file__, "kernel_sha1": kernel_sha1,
                 **({"compare_kernel_file": compare.__file__, "compare_kernel_sha1": hashlib.sha1(
                     Path(compare.__file__).read_bytes()).hexdigest()} if compare is not None else {})}
    for n in sizes:
        q, k, v = (t[:, :, :n].contiguous() for t in (q_all, k_all, v_all))
        chunk_size = max(1, chunk_elements // (B * H * n)) if args.chunk_elements else None
        eager_bytes = 3 * B * H * n * n * 4
        methods = list(args.methods)
        skipped = {}
        if "eager" in methods and eager_bytes > eager_budget:
            skipped["eager"] = f"est. {eager_bytes / 1e9:.1f} GB > budget {eager_budget / 1e9:.1f} GB"
            methods.remove("eager")
            print(f"n={n}: skipping eager ({skipped['eager']})", flush=True)
        mask = eager_mask(n) if "eager" in methods else None
        calls = make_calls(q, k, v, mask, thresholds, chunk_size, kernel.sparse_attention, pre_thresholds)
        if compare is not None:
            other = make_calls(q, k, v, mask, thresholds, chunk_size, compare.sparse_attention, pre_thresholds)
            for name in [m for m in methods if m.startswith("ours_")]:
                calls[name.replace("ours_", "before_")] = other[name]
                methods.append(name.replace("ours_", "before_"))

        if n in args.check_sizes:
            ref = calls["sdpa"]()
            check = {"dense_vs_sdpa_max_abs": float((calls["ours_dense"]() - ref).abs().max())}
            if "eager" in methods:
                check["eager_vs_sdpa_max_abs"] = float((calls["eager"]() - ref).abs().max())
            if "ours_topk" in methods and "plain_topk" in methods:
                check["topk_fused_vs_plain_max_abs"] = float((calls["ours_topk"]() - calls["plain_topk"]()).abs().max())
            if "ours_topp" in methods and "plain_topp" in methods:
                check["topp_fused_vs_plain_max_abs"] = float((calls["ours_topp"]() - calls["plain_topp"]()).abs().max())
            if "ours_skip" in methods and "plain_skip" in methods:
                check["skip_fused_vs_plain_max_abs"] = float((calls["ours_skip"]() - calls["plain_skip"]()).abs().max())
            if "ours_skip_pre" in methods and "plain_skip_pre" in methods:
                check["skip_pre_fast_vs_plain_max_abs"] = float((calls["ours_skip_pre"]() - calls["plain_skip_pre"]()).abs().max())
            if "ours_pre_sdc_vmc" in methods and "plain_pre_sdc_vmc" in methods:
                check["pre_fast_vs_plain_max_abs"] = float((calls["ours_pre_sdc_vmc"]() - calls["plain_pre_sdc_vmc"]()).abs().max())
            check["toptheta_mean_kept_per_row"] = kept_per_row(q, k, v, thresholds, chunk_size, kernel.sparse_attention)
            checks[n] = check
            print(f"n={n} check: " + ", ".join(f"{key}={val:.3g}" for key, val in check.items()), flush=True)
            del ref
        if n < 8192:  # warm-up (first-call dispatch, thread pools); larger sizes follow warmed ones
            for name in methods:
                calls[name]()

        times = {m: [] for m in methods}
        peaks = {m: [] for m in methods}
        cpu_times = {m: [] for m in methods}
        for r in range(repeats.get(n, 1)):
            for name in methods:
                with PeakRSS() as mem:
                    c0, t0 = time.process_time(), time.perf_counter()
                    out = calls[name]()
                    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                del out
                times[name].append(elapsed)
                cpu_times[name].append(cpu)
                peaks[name].append(mem.peak_extra)
                print(f"n={n} rep {r} {name:14s} {elapsed:8.4f}s wall {cpu:8.4f}s cpu  peak +{mem.peak_extra / MB:8.1f} MB "
                      f"({mem.samples} samples)", flush=True)
        prof = {}
        if n <= args.profile_max_n:
            for name in methods:
                if name == "eager" and n > 2048:
                    continue
                prof[name] = profiled_peak_bytes(calls[name])
                print(f"n={n} profiler {name:14s} peak +{prof[name] / MB:8.1f} MB", flush=True)

        base_t = statistics.median(times["sdpa"]) if "sdpa" in times else None
        base_m = max(peaks["sdpa"]) if "sdpa" in peaks else None
        base_c = statistics.median(cpu_times["sdpa"]) if "sdpa" in cpu_times else None
        base_tmin = min(times["sdpa"]) if "sdpa" in times else None
        base_cmin = min(cpu_times["sdpa"]) if "sdpa" in cpu_times else None
        base_p = prof.get("sdpa")
        for name in [m for m in args.methods if m in skipped or m in methods] + \
                [m for m in methods if m.startswith("before_")]:
            if name in skipped:
                results.append({"n": n, "method": name, "skipped": skipped[name],
                                "eager_estimate_GB": eager_bytes / 1e9})
                continue
            t, m = statistics.median(times[name]), max(peaks[name])
            results.append({
                "n": n, "method": name, "time_s": t, "times_s": times[name],
                "peak_extra_MB": m / MB, "peak_extra_MB_all": [x / MB for x in peaks[name]],
                "time_ratio": t / base_t if base_t else None,
                "cpu_s": statistics.median(cpu_times[name]), "cpu_times_s": cpu_times[name],
                "cpu_ratio": statistics.median(cpu_times[name]) / base_c if base_c else None,
                "time_min_s": min(times[name]), "time_min_ratio": min(times[name]) / base_tmin if base_tmin else None,
                "cpu_min_s": min(cpu_times[name]),
                "cpu_min_ratio": min(cpu_times[name]) / base_cmin if base_cmin else None,
                "prof_ratio": prof[name] / base_p if base_p and name in prof else None,
                "mem_ratio": m / base_m if base_m else None,
                "prof_peak_MB": prof[name] / MB if name in prof else None,
                "repeats": len(times[name]),
                **({"rows_per_chunk": rows_per_chunk(kernel, n, chunk_size)} if name.startswith("ours") else {}),
                **({"rows_per_chunk": rows_per_chunk(compare, n, chunk_size)} if name.startswith("before") else {}),
            })
        del calls, mask, q, k, v
        write_report(args, results, checks, meta_base, thresholds, final=False)

    write_report(args, results, checks, meta_base, thresholds, final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
