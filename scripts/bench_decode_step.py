"""A whole decode step of a one-layer SmolLM2-shaped model: sdpa against Top-θ post + VMC, side by side (CPU).

Used by ``scripts/bench_decode.py --step``. The kernel alone is not what a user waits for: a decode step also runs
the embedding, the projections, RoPE, the cache update, the MLP, the head and our per-call Python (the backend
registry, the lowering, the running V sum, the statistics). Here two copies of one random-weight model (SmolLM2's
attention and MLP widths, one layer, a small vocabulary so the head does not hide the attention) each get a
``cache.growing_cache`` filled by the same sdpa prefill of --step-len random tokens; one runs sdpa, the other runs
inside ``toptheta.sparsify(TopTheta(post), [VMC()])`` with statistics on, as in a real run. Then both decode the
same tokens, alternating step by step, so both caches hold the same keys at each timed step.

θ per head is the (1 − f)-quantile of that head's probabilities at the first decode step, f chosen so that the
union over a KV head's G query heads is about --step-fraction of the V rows (as ``bench_decode.thresholds_for``);
the realised fraction over the timed steps is read from the statistics.

``profile_step`` runs cProfile over a few steps of our model, for the overhead table of the report.
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import statistics
import time

import torch

import toptheta
from toptheta.attention.backend import decoding
from toptheta.attention.cache import cache_keyword, growing_cache
from toptheta.thresholds import Thresholds

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
VOCAB = 1024  # small on purpose: SmolLM2's 49k-row head alone would take longer than the attention at 16k


def one_layer_model(seed: int = 0):
    """A seeded one-layer Llama with SmolLM2-135M's attention and MLP shapes, float32, sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, num_hidden_layers=1, max_position_embeddings=1 << 17,
                         rope_theta=100000.0, tie_word_embeddings=True, **SMOLLM2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model.eval()


class Stepper:
    """One model and its cache; ``step(token)`` runs one decode forward and returns the logits (1, VOCAB)."""

    def __init__(self, model, cache, length: int):
        self.model, self.cache, self.length = model, cache, length
        self.keyword = cache_keyword(model)  # (inspect.signature: once, not in every timed step)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        pos = torch.tensor([[self.length]])
        with torch.no_grad():
            out = self.model(input_ids=token.view(1, 1), position_ids=pos, use_cache=True, logits_to_keep=1,
                             **{self.keyword: self.cache})
        self.length += 1
        return out.logits[:, -1]


def prefilled(model, ids: torch.Tensor):
    """A growing cache after an sdpa prefill of ``ids`` (1, K)."""
    cache = growing_cache(model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})
    return cache


def step_thresholds(model, cache, token: torch.Tensor, length: int, union: float) -> Thresholds:
    """Post-softmax θ per head from the probabilities of one decode step on a copy of the cache (see module doc)."""
    seen = []
    probe = copy.deepcopy(model)
    with toptheta.sparsify(probe, toptheta.Dense(), observer=lambda rows: seen.append(rows.logits.clone())):
        with decoding(probe):
            Stepper(probe, copy.deepcopy(cache), length).step(token)
    s = seen[-1][0, :, 0]  # (H, K) logits of the decode row
    H, G = s.shape[0], model.config.num_attention_heads // model.config.num_key_value_heads
    f = 1 - (1 - union) ** (1 / G)
    theta = torch.quantile(torch.softmax(s, -1), 1 - f, dim=-1)  # (H,)
    return Thresholds(theta.view(1, H, 1), [64], "post")


def run_step(length: int = 16384, fraction: float = 0.1, steps: int = 40, warmup: int = 3, seed: int = 0) -> dict:
    """Median/min per-step time of sdpa and of Top-θ post + VMC, side by side; their ratio; kept V-row fraction."""
    model = one_layer_model(seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    tokens = torch.randint(0, VOCAB, (warmup + steps,), generator=g)
    cache = prefilled(model, ids)
    thresholds = step_thresholds(model, cache, tokens[0], length, fraction)
    ours_model = copy.deepcopy(model)
    dense = Stepper(model, cache, length)
    ours = Stepper(ours_model, copy.deepcopy(cache), length)
    times = {"sdpa": [], "ours_post_vmc": []}
    cpu = {"sdpa": [], "ours_post_vmc": []}  # process CPU time: what a step costs, less the waits of a shared machine
    max_diff = 0.0
    with toptheta.sparsify(ours_model, toptheta.TopTheta(thresholds), [toptheta.VMC()]) as stats, \
            decoding(ours_model):
        for i, token in enumerate(tokens):
            c0, t0 = time.process_time(), time.perf_counter()
            a = dense.step(token)
            c1, t1 = time.process_time(), time.perf_counter()
            b = ours.step(token)
            c2, t2 = time.process_time(), time.perf_counter()
            if i == warmup - 1:
                stats.reset()  # count only the timed steps
            if i >= warmup:
                times["sdpa"].append(t1 - t0)
                times["ours_post_vmc"].append(t2 - t1)
                cpu["sdpa"].append(c1 - c0)
                cpu["ours_post_vmc"].append(c2 - c1)
                max_diff = max(max_diff, float((a - b).abs().max()))
        backend_calls = dict(stats.backend_calls)
        kept = stats.kept_vrow_fraction
    med = {m: statistics.median(t) for m, t in times.items()}
    low = {m: min(t) for m, t in times.items()}
    return {"kv_len": length, "target_vrow_fraction": fraction, "steps": steps, "vrow_fraction": kept,
            "backend_calls": backend_calls, "logits_max_abs_diff": max_diff,
            "methods": {m: {"time_s": med[m], "time_min_s": low[m], "cpu_s": statistics.median(cpu[m]),
                            "times_s": times[m]} for m in times},
            "speedup": med["sdpa"] / med["ours_post_vmc"], "speedup_min": low["sdpa"] / low["ours_post_vmc"],
            "speedup_cpu": statistics.median(cpu["sdpa"]) / statistics.median(cpu["ours_post_vmc"])}


def profile_step(length: int = 16384, fraction: float = 0.1, steps: int = 20, seed: int = 0, top: int = 25) -> str:
    """cProfile of ``steps`` decode steps of our model (after two warm-up steps): the top functions by own time."""
    model = one_layer_model(seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, length), generator=g)
    tokens = torch.randint(0, VOCAB, (steps + 2,), generator=g)
    cache = prefilled(model, ids)
    thresholds = step_thresholds(model, cache, tokens[0], length, fraction)
    ours = Stepper(model, cache, length)
    with toptheta.sparsify(model, toptheta.TopTheta(thresholds), [toptheta.VMC()]), decoding(model):
        ours.step(tokens[0])
        ours.step(tokens[1])
        prof = cProfile.Profile()
        prof.enable()
        for token in tokens[2:]:
            ours.step(token)
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()
