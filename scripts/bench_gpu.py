"""GPU attention benchmarks: FlashAttention (torch sdpa, flash backend) against our Triton kernels, side by side.

Used by ``scripts/bench_attention.py --device cuda`` (prefill) and ``scripts/bench_decode.py --device cuda``
(decode). Shapes are one LLaMA-3-8B layer (B = 1, 32 query heads, 8 KV heads, head_dim 128), bfloat16:
prefill of 4k, 16k and 32k tokens (causal), decode of one query row over 16k and 64k cached keys. Methods:

    flash              torch.nn.functional.scaled_dot_product_attention inside
                       sdpa_kernel(SDPBackend.FLASH_ATTENTION), GQA by enable_gqa (K/V expanded once, outside
                       the timed call, where this torch's flash kernel refuses enable_gqa: the row says so)
    ours_pre_sdc_vmc   prefill: TopTheta(pre) + exact SDC + VMC through toptheta.sparse_attention
    ours_post_vmc      TopTheta(post) + VMC (prefill and decode)
    skip_pre           prefill: skip-softmax (BLASST's one λ) before the softmax, no compensation (as deployed)
    skip_post_vmc      skip-softmax after the softmax + VMC (prefill and decode)
    topk_post_vmc      decode: Top-k after the softmax + VMC (k per head such that the union keeps about the target)
    topp_post_vmc      decode: top-p after the softmax + VMC (p: the mean mass of each head's k largest probabilities)
    plain_topk_post_vmc, plain_topp_post_vmc
                       decode: the same through the plain kernel (TOPTHETA_BACKEND=plain), what served them before

at kept fractions --fractions (default 1/3 and 1/10: of the attention elements for prefill, of the V rows, the union
over a KV head's query heads, for decode). Our calls go through the backend registry as in a run (statistics on); the
backend that served them is recorded (``backend_calls``), so a fallback to the plain kernel cannot pass unseen.

Timing: CUDA events around each call, torch.cuda.synchronize() before and after; methods interleaved repeat by
repeat; the median and the min of --repeats calls, ratios to flash of the same statistic.

Thresholds (inputs are standard normal, so logits are about N(0, σ²) per head): pre-softmax θ per head is the
(1 − u)-quantile of a sample of its logits, which keeps about u of every row; post-softmax θ(n) = e^t / (n·E e^s)
with t that quantile (a row's probabilities are e^s / Σ e^s, Σ ≈ n·E e^s); decode θ per head is the quantile of its
probabilities that makes the union over G heads about u (as ``bench_decode.thresholds_for``). The realised fractions
come from the statistics and are in the report. Skip-softmax's λ = n·e^{t − m̄}, m̄ the mean row maximum of the
sample and n the mean row length (N/2 for causal prefill, K for decode), puts the cut m + ln(λ/n) near t. iid
inputs have no structure: a key tile in which nothing passes θ is rare, so prefill tile skipping shows only on real
activations.

``--device cpu-interpret`` runs the same code on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1,
TOPTHETA_BACKEND=triton), float32, tiny shapes (4 heads, 2 KV heads, head_dim 16) unless given: a check that the
GPU path runs, not a measurement.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import torch

import toptheta
from toptheta.attention.stats import SparsityStats
from toptheta.thresholds import Thresholds
from toptheta.results import bench_report

SHAPES = {"llama3-8b": (32, 8, 128), "tiny": (4, 2, 16)}
PREFILL_LENGTHS = [4096, 16384, 32768]
DECODE_LENGTHS = [16384, 65536]
K_BUDGET = 64


def resolve_device(name: str) -> torch.device:
    """The device of ``--device cuda`` or ``cpu-interpret``, or SystemExit with the fix."""
    from toptheta.attention import triton as kernels

    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device cuda: this torch ({torch.__version__}, CUDA build: {torch.version.cuda}) sees no "
                             "CUDA device. Run on a GPU machine (setup.sh keeps a CUDA torch as it is), or use "
                             "--device cpu-interpret for a dry run of the same code on CPU through Triton's interpreter")
        if not kernels.available():
            raise SystemExit("--device cuda: triton cannot be imported; `pip install triton` (CUDA builds of torch "
                             "bring it)")
        return torch.device("cuda")
    if name == "cpu-interpret":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":  # its kernels would be GPU ones
            raise SystemExit("--device cpu-interpret: triton was imported without TRITON_INTERPRET=1; set it in the "
                             "environment (TRITON_INTERPRET=1 python scripts/...)")
        os.environ["TRITON_INTERPRET"] = "1"
        if not kernels.available():
            raise SystemExit("--device cpu-interpret: triton cannot be imported; `pip install triton`")
        return torch.device("cpu")
    raise SystemExit(f"--device must be cpu, cuda or cpu-interpret, got {name!r}")


class Forced:
    """TOPTHETA_BACKEND=triton for the block on CPU (the Triton backend takes CPU tensors only when forced)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self.saved = os.environ.get("TOPTHETA_BACKEND")
        if self.device.type == "cpu":
            os.environ["TOPTHETA_BACKEND"] = "triton"
        return self

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("TOPTHETA_BACKEND", None)
        else:
            os.environ["TOPTHETA_BACKEND"] = self.saved


def elapsed(fn, device: torch.device) -> float:
    """Seconds of one call: CUDA events between synchronisations on a GPU, the wall clock elsewhere."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def time_calls(calls: dict, device: torch.device, repeats: int) -> dict:
    for fn in calls.values():  # warm-up: compilation, autotuning, running sums
        fn()
    times = {m: [] for m in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(elapsed(fn, device))
    return {m: {"time_s": statistics.median(t), "time_min_s": min(t), "times_s": t} for m, t in times.items()}


def flash_call(q, k, v, scaling: float, causal: bool):
    """FlashAttention through sdpa; (call, how GQA is served)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def run(kk, vv, gqa):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, kk, vv, is_causal=causal, scale=scaling, enable_gqa=gqa)

    try:
        run(k, v, True)
        return (lambda: run(k, v, True)), "enable_gqa"
    except RuntimeError:  # this flash kernel takes no GQA: expand once, outside the timed call
        G = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        run(ke, ve, False)
        return (lambda: run(ke, ve, False)), "expanded"


def random_qkv(kind: str, n: int, shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Standard normal (q, k, v) of one layer: n query rows for prefill, one for decode, over n keys."""
    H, Hkv, D = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    Q = n if kind == "prefill" else 1
    q = torch.randn(1, H, Q, D, generator=g).to(device, dtype)
    k = torch.randn(1, Hkv, n, D, generator=g).to(device, dtype)
    v = torch.randn(1, Hkv, n, D, generator=g).to(device, dtype)
    return q, k, v


def kernel_setup(device_name: str) -> tuple:
    """(device, interpreted, shape, dtype, meta) of --tune and --profile: LLaMA-3-8B shapes in bf16 on a GPU, tiny
    ones in float32 in the interpreter (a dry run)."""
    device = resolve_device(device_name)
    interpret = device.type == "cpu"
    shape, dtype = ("tiny", torch.float32) if interpret else ("llama3-8b", torch.bfloat16)
    meta = bench_report.machine(device=device_name, gpu=None if interpret else torch.cuda.get_device_name(),
                                dtype=str(dtype), batch=1, shape=dict(zip(("heads", "kv_heads", "head_dim"),
                                                                          SHAPES[shape])))
    return device, interpret, shape, dtype, meta


def logit_sample(q, k, scaling: float, rows: int = 128, keys: int = 2048) -> torch.Tensor:
    """(H, rows·keys) float32 logits of sampled queries against the first keys (GQA: head h reads KV head h // G)."""
    G = q.shape[1] // k.shape[1]
    idx = torch.linspace(0, q.shape[2] - 1, min(rows, q.shape[2]), device=q.device).long()
    qs = q[0, :, idx].float()  # (H, rows, D)
    ks = k[0, :, :keys].float().repeat_interleave(G, 0)  # (H, keys, D)
    return (qs @ ks.transpose(1, 2) * scaling).flatten(1)


def prefill_thresholds(q, k, scaling: float, u: float) -> tuple[Thresholds, Thresholds]:
    """(pre, post) thresholds keeping about u of every row of iid inputs (module docstring)."""
    s = logit_sample(q, k, scaling)  # (H, S)
    H, n_max = s.shape[0], q.shape[2]
    t = torch.quantile(s.cpu(), 1 - u, dim=-1)  # (H,)
    mean_exp = s.double().exp().mean(-1).cpu()  # (H,) E e^s
    n = torch.arange(n_max + 1, dtype=torch.float64).clamp_min(1)
    post = (t.double().exp()[:, None] / (n[None] * mean_exp[:, None])).float()  # (H, N)
    return (Thresholds(t.view(1, H, 1), [K_BUDGET], "pre"), Thresholds(post[None], [K_BUDGET], "post"))


def decode_thresholds(q, k, scaling: float, u: float) -> Thresholds:
    """Post-softmax θ per head: the union over a KV head's G heads keeps about u of the V rows."""
    H, Hkv = q.shape[1], k.shape[1]
    G = H // Hkv
    s = torch.einsum("hd,hkd->hk", q[0, :, 0].float(), k[0].float().repeat_interleave(G, 0)) * scaling  # (H, K)
    f = 1 - (1 - u) ** (1 / G)
    theta = torch.quantile(torch.softmax(s, -1).cpu(), 1 - f, dim=-1)  # (H,)
    return Thresholds(theta.view(1, H, 1), [K_BUDGET], "post")


def skip_lambda(q, k, scaling: float, u: float, n: float) -> float:
    """λ whose cut m + ln(λ/n) sits near the (1 − u)-quantile of the logits for rows of n keys (module docstring)."""
    s = logit_sample(q, k, scaling)  # (H, S)
    t = float(torch.quantile(s.cpu().flatten()[:1 << 20], 1 - u))
    rows = min(128, q.shape[2])
    m = float(s.view(s.shape[0], rows, -1).amax(-1).mean())
    return float(n) * float(torch.tensor(t - m).exp())


def ours_call(q, k, v, scaling, sparsifier, compensations, phase, stats, backend: str | None = None):
    """One attention call through the backend registry; ``backend`` forces one for this call alone."""
    def call():
        saved = os.environ.get("TOPTHETA_BACKEND")
        if backend is not None:
            os.environ["TOPTHETA_BACKEND"] = backend
        try:
            return toptheta.sparse_attention(q, k, v, None, scaling=scaling, layer=0, sparsifier=sparsifier,
                                             compensations=compensations, stats=stats, phase=phase)
        finally:
            if saved is None:
                os.environ.pop("TOPTHETA_BACKEND", None)
            else:
                os.environ["TOPTHETA_BACKEND"] = saved
    return call


def decode_k(n: int, groups: int, u: float) -> int:
    """Top-k's k per head for a decode row of n keys whose union over ``groups`` heads keeps about u of the V rows
    (each head keeps f = 1 − (1 − u)^{1/G}, as ``decode_thresholds``)."""
    return max(1, round((1 - (1 - u) ** (1 / groups)) * n))


def decode_p(q, k, scaling: float, top: int) -> float:
    """Top-p's p for a decode row: the mean over heads of the mass of each head's ``top`` largest probabilities (so
    that a head keeps about ``top`` keys, as Top-k with k = top)."""
    H, Hkv = q.shape[1], k.shape[1]
    s = torch.einsum("hd,hkd->hk", q[0, :, 0].float(), k[0].float().repeat_interleave(H // Hkv, 0)) * scaling
    return float(torch.softmax(s, -1).topk(top, dim=-1).values.sum(-1).mean())


def measure(kind: str, device: torch.device, shape: str, lengths: list[int], fractions: list[float], repeats: int,
            dtype: torch.dtype, seed: int = 0) -> list[dict]:
    """Rows of the prefill (kind "prefill") or decode ("decode") benchmark."""
    H, Hkv, D = SHAPES[shape]
    scaling = D ** -0.5
    rows = []
    for n in lengths:
        q, k, v = random_qkv(kind, n, shape, device, dtype, seed)
        flash, gqa = flash_call(q, k, v, scaling, causal=kind == "prefill")
        for u in fractions:
            methods = {}
            if kind == "prefill":
                pre, post = prefill_thresholds(q, k, scaling, u)
                methods["ours_pre_sdc_vmc"] = (toptheta.TopTheta(pre), [toptheta.SDC("exact"), toptheta.VMC()])
                methods["ours_post_vmc"] = (toptheta.TopTheta(post), [toptheta.VMC()])
                lam = skip_lambda(q, k, scaling, u, n / 2)
                methods["skip_pre"] = (toptheta.SkipSoftmax(lam, "pre", k=K_BUDGET), [])
                methods["skip_post_vmc"] = (toptheta.SkipSoftmax(lam, "post", k=K_BUDGET), [toptheta.VMC()])
            else:
                methods["ours_post_vmc"] = (toptheta.TopTheta(decode_thresholds(q, k, scaling, u)), [toptheta.VMC()])
                lam = skip_lambda(q, k, scaling, u, n)
                methods["skip_post_vmc"] = (toptheta.SkipSoftmax(lam, "post", k=K_BUDGET), [toptheta.VMC()])
                k_head = decode_k(n, H // Hkv, u)
                topk = toptheta.TopK(k_head, "post")
                topp = toptheta.TopP(min(1.0, decode_p(q, k, scaling, k_head)), "post", k=K_BUDGET)
                methods["topk_post_vmc"] = (topk, [toptheta.VMC()])
                methods["topp_post_vmc"] = (topp, [toptheta.VMC()])
                methods["plain_topk_post_vmc"] = (topk, [toptheta.VMC()], "plain")
                methods["plain_topp_post_vmc"] = (topp, [toptheta.VMC()], "plain")
            calls, kept, served, err = {"flash": flash}, {}, {}, {}
            reference = flash().float()
            for name, (sparsifier, comp, *backend) in methods.items():
                probe = SparsityStats(1, H, Hkv)
                out = ours_call(q, k, v, scaling, sparsifier, comp, kind, probe, *backend)()
                kept[name] = probe.kept_attention_fraction if kind == "prefill" else probe.kept_vrow_fraction
                served[name] = dict(probe.backend_calls)
                err[name] = float((out.float().transpose(1, 2) - reference).abs().mean())
                calls[name] = ours_call(q, k, v, scaling, sparsifier, comp, kind, SparsityStats(1, H, Hkv), *backend)
            timing = time_calls(calls, device, repeats)
            base = timing["flash"]
            for name, t in timing.items():
                rows.append({"phase": kind, "shape": shape, "dtype": str(dtype).removeprefix("torch."), "length": n,
                             "target_fraction": u, "method": name, "kept_fraction": kept.get(name, 1.0),
                             "backend_calls": served.get(name), "flash_gqa": gqa if name == "flash" else None,
                             "mean_abs_diff_to_flash": err.get(name), **t,
                             "time_ratio": t["time_s"] / base["time_s"], "min_ratio": t["time_min_s"] / base["time_min_s"]})
                print(f"{kind} n={n} u={u:.3f} {name:17s} {t['time_s'] * 1e3:9.3f} ms median "
                      f"({rows[-1]['time_ratio']:.2f}x flash), kept {rows[-1]['kept_fraction']:.3f}, {served.get(name)}",
                      flush=True)
        del q, k, v
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(kind: str, device_name: str, lengths: list[int] | None, fractions: list[float], repeats: int, out: str,
        command: str, shape: str | None = None, seed: int = 0) -> list[dict]:
    """The whole benchmark of one kind: check the device, measure, write OUT.{json,md}."""
    device = resolve_device(device_name)
    interpret = device.type == "cpu"
    shape = shape or ("tiny" if interpret else "llama3-8b")
    lengths = lengths or (PREFILL_LENGTHS if kind == "prefill" else DECODE_LENGTHS)
    dtype = torch.float32 if interpret else torch.bfloat16
    meta = bench_report.machine(device=device_name, gpu=torch.cuda.get_device_name() if not interpret else None,
                                shape=dict(zip(("heads", "kv_heads", "head_dim"), SHAPES[shape])), dtype=str(dtype),
                                batch=1, triton_interpret=interpret)
    with Forced(device):
        rows = measure(kind, device, shape, lengths, fractions, repeats, dtype, seed)
    bench_report.finish(meta)
    what = "kept attention elements" if kind == "prefill" else "kept V rows"
    lines = [f"# {kind.capitalize()} attention on {device_name}: FlashAttention (sdpa) against our Triton kernels", "",
             f"{bench_report.describe(meta)} {meta['gpu'] or 'Triton interpreter on CPU (a dry run, not a timing)'}; "
             f"{shape} shapes, {meta['dtype']}. Ratios are to flash of the same statistic, measured in this process.",
             "", f"| length | target | method | {what} | backend | median ms | ×flash | min ms | ×flash (min) |",
             "|---:|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        backend = ", ".join(r["backend_calls"]) if r["backend_calls"] else f"sdpa flash ({r['flash_gqa']})"
        lines.append(f"| {r['length']} | {r['target_fraction']:.3f} | {r['method']} | {r['kept_fraction']:.3f} | "
                     f"{backend} | {r['time_s'] * 1e3:.3f} | {r['time_ratio']:.2f} | {r['time_min_s'] * 1e3:.3f} | "
                     f"{r['min_ratio']:.2f} |")
    lines += ["", "Targets (issue 29): pre-softmax Top-θ prefill ≤ 1.2× FlashAttention at 1/3 kept and faster at 1/10 "
              "(tile skipping, which iid inputs rarely allow); decode ≥ 1.5× faster than sdpa at 1/10 of the V rows."]
    bench_report.write(out, command, meta, {kind: rows}, lines)
    return rows



# ---- tile and launch settings: which the wrappers should default to ------------------------------------------------

PREFILL_CONFIGS = [(64, 64, 4, 2, True), (64, 64, 4, 3, True), (128, 64, 8, 2, True), (128, 64, 8, 3, True),
                   (64, 64, 4, 2, False), (64, 64, 4, 3, False), (128, 64, 8, 3, False),
                   (128, 128, 8, 3, False)]  # BLOCK_M, BLOCK_N, warps, stages, tile skipping
DECODE_CONFIGS = [(64, 4, 2, None), (64, 2, 2, None), (128, 2, 2, None), (64, 2, 2, 17), (64, 2, 2, 33),
                  (64, 2, 2, 132), (128, 4, 2, 33), (32, 2, 2, None)]  # BLOCK_N, warps, stages, chunks (None: default)


def tune(prefill_len: int, decode_len: int, u: float, repeats: int, out: str, command: str,
         device_name: str = "cuda") -> list[dict]:
    """Our kernels alone (v̄ given, θ per row precomputed) under each launch setting, against flash of the same
    shapes: LLaMA-3-8B, bf16, Top-θ pre + exact SDC + VMC and post + VMC at kept fraction u."""
    from toptheta.attention.triton import lowering
    from toptheta.attention.triton.common import row_bounds, value_means
    from toptheta.attention.triton.decode import decode_attention
    from toptheta.attention.triton.prefill import prefill_attention

    device, interpret, shape, dtype, meta = kernel_setup(device_name)
    H, Hkv, D = SHAPES[shape]
    scaling = D ** -0.5
    rows = []
    for kind, n in (("prefill", prefill_len), ("decode", decode_len)):
        q, k, v = random_qkv(kind, n, shape, device, dtype)
        Q = q.shape[2]
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        lo, hi = row_bounds(zero, zero + n, zero + n - Q, Q, None, True)
        v_mean = value_means(v, lo, hi)
        flash, _ = flash_call(q, k, v, scaling, causal=kind == "prefill")
        if kind == "prefill":
            pre, post = prefill_thresholds(q, k, scaling, u)
            settings = [("pre", pre, "exact"), ("post", post, None)]
            configs = PREFILL_CONFIGS
        else:
            settings = [("post", decode_thresholds(q, k, scaling, u), None)]
            configs = DECODE_CONFIGS
        for placement, thresholds, sdc in settings:
            theta, _ = lowering.row_thresholds(toptheta.TopTheta(thresholds), 0, hi - lo)
            calls = {"flash": flash}
            for cfg in configs:
                if kind == "prefill":
                    bm, bn, warps, stages, skip = cfg
                    kw = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, skip_tiles=skip)
                    fn = prefill_attention
                else:
                    bn, warps, stages, splits = cfg
                    kw = dict(block_n=bn, num_warps=warps, num_stages=stages, splits=splits)
                    fn = decode_attention
                calls[str(cfg)] = functools.partial(fn, q, k, v, scaling=scaling, theta=theta, placement=placement,
                                                    sdc=sdc, vmc=True, v_mean=v_mean, **kw)
            timing = time_calls(calls, device, repeats)
            for name, t in timing.items():
                rows.append({"phase": kind, "length": n, "placement": placement, "config": name, **t,
                             "time_ratio": t["time_s"] / timing["flash"]["time_s"]})
                print(f"tune {kind} n={n} {placement} {name:18s} {t['time_s'] * 1e3:8.3f} ms "
                      f"({rows[-1]['time_ratio']:.2f}x flash)", flush=True)
        del q, k, v, calls, flash  # the calls hold them: free the length's tensors before the next one's
        if not interpret:
            torch.cuda.empty_cache()
    bench_report.finish(meta)
    lines = ["# Launch settings of our Triton kernels (kernel alone, v̄ given) against FlashAttention", "",
             f"{bench_report.describe(meta)} {meta['gpu'] or 'Triton interpreter (a dry run)'}; kept fraction {u:.3f}. Prefill configs are (BLOCK_M, "
             "BLOCK_N, warps, stages, tile skipping), decode (BLOCK_N, warps, stages, key chunks per (sequence, KV head); "
             "None: the default, 4 programs per SM).", "",
             "| phase | length | placement | config | median ms | ×flash |", "|---|---:|---|---|---:|---:|"]
    lines += [f"| {r['phase']} | {r['length']} | {r['placement']} | {r['config']} | {r['time_s'] * 1e3:.3f} | "
              f"{r['time_ratio']:.2f} |" for r in rows]
    bench_report.write(out, command, meta, {"tune": rows}, lines)
    return rows


def profile(prefill_len: int, decode_len: int, u: float, out: str, command: str, device_name: str = "cuda") -> list[dict]:
    """Where one layer call's device time goes, through ``toptheta.sparse_attention`` as in a run (statistics on):
    torch.profiler's kernels of 3 calls after a warm-up, prefill (Top-θ pre + exact SDC + VMC) and decode (post +
    VMC), LLaMA-3-8B shapes; the kernels alone against the wrapper's own torch ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device, interpret, shape, dtype, meta = kernel_setup(device_name)
    H, Hkv, D = SHAPES[shape]
    scaling = D ** -0.5
    activities = [ProfilerActivity.CPU] + ([] if interpret else [ProfilerActivity.CUDA])
    rows, lines = [], []
    for kind, n in (("prefill", prefill_len), ("decode", decode_len)):
        q, k, v = random_qkv(kind, n, shape, device, dtype)
        if kind == "prefill":
            sparsifier, comp = toptheta.TopTheta(prefill_thresholds(q, k, scaling, u)[0]), [toptheta.SDC("exact"),
                                                                                           toptheta.VMC()]
        else:
            sparsifier, comp = toptheta.TopTheta(decode_thresholds(q, k, scaling, u)), [toptheta.VMC()]
        call = ours_call(q, k, v, scaling, sparsifier, comp, kind, SparsityStats(1, H, Hkv))
        with Forced(device):
            call()
            if not interpret:
                torch.cuda.synchronize()
            with torch_profile(activities=activities) as prof:
                for _ in range(3):
                    call()
                if not interpret:
                    torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if (e.self_device_time_total if not interpret else e.self_cpu_time_total) > 0]
        time_of = (lambda e: e.self_cpu_time_total) if interpret else (lambda e: e.self_device_time_total)
        events.sort(key=time_of, reverse=True)
        total = sum(time_of(e) for e in events)
        lines += ["", f"## {kind}, {n} keys, {sparsifier.placement}-softmax: {total / 3 / 1e3:.3f} ms of device time "
                      f"per call", "", "| kernel or op | calls per layer call | µs per layer call | share |",
                  "|---|---:|---:|---:|"]
        for e in events[:25]:
            rows.append({"phase": kind, "length": n, "name": e.key, "count": e.count / 3, "us": time_of(e) / 3,
                         "share": time_of(e) / total})
            lines.append(f"| `{e.key[:70]}` | {e.count / 3:g} | {time_of(e) / 3:.1f} | {time_of(e) / total:.1%} |")
        print("\n".join(lines[-min(len(events), 25) - 4:]), flush=True)
        del q, k, v
    bench_report.finish(meta)
    head = ["# Where a layer call's device time goes (torch.profiler, self time per kernel)", "",
            f"{bench_report.describe(meta)} {meta['gpu'] or 'Triton interpreter (CPU time of a dry run)'}; kept "
            f"fraction {u:.3f}; through toptheta.sparse_attention with statistics on."]
    bench_report.write(out, command, meta, {"profile": rows}, head + lines)
    return rows


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Launch settings of the Triton kernels on a GPU (--tune); the "
                                            "benchmarks themselves run from bench_attention.py / bench_decode.py")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--tune", action="store_true", help="the kernels alone under several launch settings")
    what.add_argument("--profile", action="store_true", help="torch.profiler's kernel table of one layer call")
    p.add_argument("--prefill-len", type=int, default=16384)
    p.add_argument("--decode-len", type=int, default=65536)
    p.add_argument("--fraction", type=float, default=1 / 3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="output stem (default results/bench/gpu_tune or gpu_profile)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu-interpret"])
    args = p.parse_args(argv)
    command = bench_report.command_line("bench_gpu.py", argv)
    if args.profile:
        profile(args.prefill_len, args.decode_len, args.fraction, args.out or "results/bench/gpu_profile", command,
                args.device)
    else:
        tune(args.prefill_len, args.decode_len, args.fraction, args.repeats, args.out or "results/bench/gpu_tune",
             command, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
