"""What one attention layer call costs a GPU, counted on a CPU: torch ops dispatched, Triton launches, host reads.

    python scripts/bench_gpu_cost.py                    # 4k and 32k tokens; writes results/bench/gpu_cost.{md,json}
    python scripts/bench_gpu_cost.py --tokens 4096 --no-cpu-backends   # the accelerator path only (seconds)

On a GPU every dispatched torch op is (at least) one kernel launch and every host read of a tensor value (``.item()``,
``bool()``, ``int()``, ``.tolist()``, ``.cpu()``) a synchronisation. One layer of LLaMA-3-8B's shapes (32 query heads,
8 KV heads, head dim 128, batch 1) runs through each backend the registry has (``TOPTHETA_BACKEND``):

* the accelerator path on ``meta`` tensors (shapes without values: nothing is computed, every op is still
  dispatched, and a host read is counted and answered with a dummy value instead of raising): what the registry
  chooses off the CPU (sdpa for dense, the plain kernel with its element budget per chunk otherwise), and the
  Triton backend where ``toptheta.attention.triton`` imports (its launches counted by wrapping ``JITFunction.run``);
* the CPU backends on real CPU tensors: decode at every length, prefill only up to ``--cpu-prefill-max`` (1024
  tokens by default; one 4k CPU prefill of these shapes takes about a minute here).

Targets (issue 29): no host read inside any layer call on the GPU path; the plain path ≤ 1 host read per forward
(the mask function may read a static cache's offset once); Triton prefill ≤ 6 launches per layer call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import toptheta  # noqa: E402
from toptheta.attention import backends  # noqa: E402
from toptheta.attention.host_reads import by_kind, counting_host_reads  # noqa: E402
from toptheta.calibration import Thresholds  # noqa: E402

H, HKV, D, K_BUDGET = 32, 8, 128, 64  # LLaMA-3-8B: 32 query heads, 8 KV heads, head dim 128; k = 64


class Counter(TorchDispatchMode):
    """Counts every op that reaches the dispatcher (aten level: what a GPU would launch)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_triton_launches(tally: dict):
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    original = JITFunction.run

    def run(self, *args, **kwargs):
        tally["launches"] = tally.get("launches", 0) + 1
        return original(self, *args, **kwargs)

    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = original


@contextlib.contextmanager
def triton_on_meta(tally: dict):
    """The Triton backend's wrapper code on meta tensors: the backend and the wrappers accept the meta device, and
    each kernel launch is counted instead of compiled (there is nothing to run it on). What remains is what a GPU
    would see besides the kernels: the torch ops the wrappers and the statistics dispatch, and any host read."""
    from triton.runtime.jit import JITFunction

    from toptheta.attention.backends import triton as backend
    from toptheta.attention.triton import decode, prefill

    def launch(self, *args, **kwargs):
        tally["launches"] = tally.get("launches", 0) + 1

    def accept(check):
        return lambda kernel, *tensors: tensors[0].device if tensors[0].device.type == "meta" else check(kernel,
                                                                                                         *tensors)

    refuse_device = backend.TritonBackend.refuse_device
    saved = [(JITFunction, "run", JITFunction.run), (decode, "check_device", decode.check_device),
             (prefill, "check_device", prefill.check_device), (backend.TritonBackend, "refuse_device", refuse_device)]
    JITFunction.run = launch
    decode.check_device = accept(decode.check_device)
    prefill.check_device = accept(prefill.check_device)
    backend.TritonBackend.refuse_device = lambda self, call: (None if call.device.type == "meta" else
                                                              refuse_device(self, call))
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def thresholds(placement: str, max_n: int) -> Thresholds:
    """θ per (head, n) that keeps about a tenth of each row (the values matter on CPU only)."""
    n = torch.arange(max_n + 1).clamp(min=1).float()
    values = (torch.full((1, H, 1), 3.0) + 0.0 * n) if placement == "pre" else (10.0 / n).expand(1, H, -1).clone()
    values[..., :2] = float("nan")
    return Thresholds(values.contiguous(), [K_BUDGET], placement, sdc_mass=torch.ones(1, H, max_n + 1))


def configs(max_n: int) -> dict:
    pre, post = thresholds("pre", max_n), thresholds("post", max_n)
    return {
        "dense": (toptheta.Dense(), []),
        "top-θ post + VMC": (toptheta.TopTheta(post), [toptheta.VMC()]),
        "top-θ pre + SDC + VMC": (toptheta.TopTheta(pre), [toptheta.SDC("exact"), toptheta.VMC()]),
        "top-k post + VMC": (toptheta.TopK(K_BUDGET, "post"), [toptheta.VMC()]),
        "top-p post + VMC": (toptheta.TopP(0.9, "post", k=K_BUDGET), [toptheta.VMC()]),
    }


def inputs(phase: str, tokens: int, device: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    Q = tokens if phase == "prefill" else 1
    make = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    if device == "meta":
        make = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return make(1, H, Q, D), make(1, HKV, tokens, D), make(1, HKV, tokens, D)


def measure(backend: str | None, config, phase: str, tokens: int, device: str, dtype: torch.dtype) -> dict:
    sparsifier, comp = config
    q, k, v = inputs(phase, tokens, device, dtype)
    stats = toptheta.SparsityStats(1, H, HKV)
    previous = os.environ.get("TOPTHETA_BACKEND")
    os.environ["TOPTHETA_BACKEND"] = backend or "auto"
    call = lambda: toptheta.sparse_attention(q, k, v, None, scaling=D ** -0.5, layer=0, sparsifier=sparsifier,  # noqa
                                             compensations=comp, stats=stats, phase=phase)
    reads, launches, counter = [], {}, Counter()
    on_meta = triton_on_meta(launches) if backend == "triton" and device == "meta" else contextlib.nullcontext()
    counting = contextlib.nullcontext() if backend == "triton" and device == "meta" else counting_triton_launches(launches)
    try:
        with on_meta:
            call()  # warm-up: builds kernels, moves threshold tables, fills memos
            launches.clear()
            with counting_host_reads(reads), counting, counter:
                call()
            launched = launches.get("launches", 0)
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            call()  # timed without the counters (on meta: dispatch only)
            sync()
            seconds = time.perf_counter() - t0
    except RuntimeError as err:
        return {"error": str(err).split(": ")[-1][:160]}
    finally:
        if previous is None:
            os.environ.pop("TOPTHETA_BACKEND", None)
        else:
            os.environ["TOPTHETA_BACKEND"] = previous
    return {"backend": next(reversed(stats.backend_calls)), "torch_ops": counter.ops,
            "triton_launches": launched, "host_reads": len(reads),
            "host_reads_by_kind": by_kind(reads), "seconds": round(seconds, 3)}


def per_forward(tokens: int, max_n: int) -> list[dict]:
    """Host reads of whole forwards of a 2-layer model of these shapes on meta, with and without a padding mask
    (transformers' mask code itself may read the mask once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=H * D, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=max(max_n, tokens) + 1)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    out = []
    for label, (sparsifier, comp) in configs(max_n).items():
        if isinstance(sparsifier, toptheta.TopTheta):  # two layers of the same thresholds
            t = sparsifier.thresholds
            sparsifier = toptheta.TopTheta(Thresholds(t.values.expand(2, -1, -1).contiguous(), [K_BUDGET] * 2,
                                                      t.placement, sdc_mass=t.sdc_mass.expand(2, -1, -1).contiguous()))
        for masked in (False, True):
            kwargs = {"attention_mask": torch.ones(1, tokens, dtype=torch.long, device="meta")} if masked else {}
            with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
                with counting_host_reads([]):
                    model(ids, **kwargs)  # warm-up
                reads = []
                with counting_host_reads(reads):
                    model(ids, **kwargs)
            out.append({"tokens": tokens, "config": label, "mask": masked, "host_reads_per_forward": len(reads),
                        "host_reads_by_kind": by_kind(reads), "backends": dict(stats.backend_calls)})
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--cpu-prefill-max", type=int, default=1024,
                        help="longest CPU prefill measured (CPU rows at longer prompts take minutes each)")
    parser.add_argument("--no-cpu-backends", action="store_true")
    parser.add_argument("--device", default="meta",
                        help="the accelerator path's tensors: meta (counts only, any machine) or cuda (a GPU: also times)")
    parser.add_argument("--out", default="results/bench")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    names = [b.name for b in backends.backends()]
    rows = []
    lengths = sorted(set(args.tokens) | ({args.cpu_prefill_max} if not args.no_cpu_backends else set()))
    for tokens in lengths:
        for label, config in configs(max(lengths)).items():
            for phase in ("prefill", "decode"):
                runs = []
                if tokens in args.tokens:
                    where = f"accelerator ({args.device})"
                    runs += [(where, None, args.device, torch.bfloat16)]
                    runs += [(where, "triton", args.device, torch.bfloat16)] if "triton" in names else []
                if not args.no_cpu_backends and (phase == "decode" or tokens <= args.cpu_prefill_max):
                    runs += [("cpu", name, "cpu", torch.float32) for name in names if name not in ("triton",)]
                for where, backend, device, dtype in runs:
                    result = measure(backend, config, phase, tokens, device, dtype)
                    if "error" in result:
                        continue  # the backend does not serve this call
                    rows.append({"tokens": tokens, "config": label, "phase": phase, "where": where,
                                 "forced": backend or "auto", **result})
                    print(json.dumps(rows[-1]), flush=True)
    forwards = per_forward(min(args.tokens), max(lengths))
    write(rows, forwards, Path(args.out), " ".join(["python", "scripts/bench_gpu_cost.py", *sys.argv[1:]]))


def write(rows: list[dict], forwards: list[dict], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "torch": torch.__version__, "shapes": {"H": H, "Hkv": HKV, "D": D, "B": 1, "k": K_BUDGET},
            "unit": "one layer call", "rows": rows, "forwards": forwards}
    (out / "gpu_cost.json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = ["# GPU cost of one attention layer call, counted on CPU", "", f"Command: `{command}` (torch {torch.__version__})", "",
             "LLaMA-3-8B shapes (H=32, Hkv=8, D=128, B=1), k=64. `accelerator (meta)`: what runs off the CPU, on meta "
             "tensors (ops dispatched, nothing computed; a host read there would be a GPU synchronisation). "
             "`cpu`: the CPU backends forced with TOPTHETA_BACKEND, real tensors (there a host read costs nothing). "
             "On meta, sdpa runs its math decomposition (tens of ops); on CUDA it is one flash kernel. Targets: 0 host reads per layer call "
             "on the accelerator path; Triton prefill ≤ 6 launches per call.", "",
             "| tokens | config | phase | where | backend | torch ops | Triton launches | host reads | seconds |",
             "|---:|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['config']} | {r['phase']} | {r['where']} | {r['backend']} | {r['torch_ops']:,} | "
                     f"{r['triton_launches']} | {r['host_reads']} | {r['seconds']} |")
    lines += ["", "Whole forwards (2 layers of these shapes, meta tensors, the registry's choice): host reads per forward.",
              "", "| tokens | config | padding mask | host reads per forward | backends (layer calls, warm-up included) |",
              "|---:|---|---|---:|---|"]
    for f in forwards:
        lines.append(f"| {f['tokens']} | {f['config']} | {'yes' if f['mask'] else 'no'} | {f['host_reads_per_forward']} | "
                     f"{', '.join(f'{k}: {v}' for k, v in f['backends'].items())} |")
    (out / "gpu_cost.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'gpu_cost.md'} and {out / 'gpu_cost.json'}")


if __name__ == "__main__":
    main()
