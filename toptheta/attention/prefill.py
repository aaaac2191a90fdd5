"""Fused prefill for Top-θ (pre-softmax in one pass, post-softmax in two; SDC, VMC) and dense attention.

The fast path of ``kernel.sparse_attention`` for prompt and scoring passes. Pre-softmax Top-θ needs no
second pass over a row (method.md §2.1, §3): the threshold is a mask on the logits, and everything SDC and
VMC need comes out of the same online softmax. For a row with running maximum m,

    l = Σ_valid e^{s−m}  (the dense denominator),  R = Σ_{s>θ} e^{s−m},  o' = Σ_{s>θ} e^{s−m} v,

rescaled whenever m grows. At the end: denominator R + λ·E (E = l − R for exact SDC, (n − |S|)·e^{min(θ,m)−m}
for exp-threshold, the calibrated mass; 0 without SDC), o = o'/denominator + β·v̄ with β = 1 − R/denominator.
A row where nothing passed θ keeps its maximum (``TopTheta``'s default), which the kernel tracks on the side.
Dense attention is the same loop with every valid key kept. Post-softmax Top-θ compares probabilities, so it
needs the row's m and l first: a first pass over the key blocks computes them, a second recomputes the logits,
keeps p = e^{s−m}/l > θ and the row's maximum, and accumulates the kept e^{s−m}·v; o = o'/l (+ β·v̄ with
β = 1 − R/l): the kept keys' dense probabilities, as in the plain kernel. The loops are C++
(``fused_prefill.py``); the keep decisions, kept counts, kept mass and empty rows they report feed the same
statistics as the plain kernel.

Skip-softmax (one λ: keep s ≥ m + ln(λ/n), ``SkipSoftmax.cut``) needs the row's final maximum m before it can cut,
so it runs the post-softmax loop's two passes at either placement: the second compares each logit with the row's
cut (float64, rounded up to float32 as the plain kernel's) and keeps the weights e^{s−m}; pre-softmax then
renormalises over the kept keys (with exact SDC's λ·(l − R) where asked), post-softmax divides by l.

Everything else returns None and runs in the plain kernel: Top-k and top-p (a selection, not a threshold), observers
(calibration wants the rows), soft-capping, additive biases, the reference code's empty-row rule, and machines
where the C++ kernel cannot be built.
Set ``TOPTHETA_FAST=0`` (or ``prefill.ENABLED = False``) to compare.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from ..compensation import lower
from ..sparsifiers import Dense, SkipSoftmax, TopTheta
from ..sparsifiers.base import RowBlock
from . import fused_prefill
from .backends import call

ENABLED = os.environ.get("TOPTHETA_FAST", "1") != "0"
KEY_BLOCK = 512  # keys per GEMM block: the (G·rows, keys) logits block stays in L2
MAX_QUERY_BLOCK = 64  # queries per task (times G heads = rows of one GEMM)
KEEP_ALL = call.KEEP_ALL  # θ that keeps every valid key (the kernel's "no key" sentinel is −1e30)


def supports(sparsifier, compensations: Sequence = (), *, observer=None, softcap=None, bias=None,
             device: str = "cpu", phase: str = "prefill") -> bool:
    """Whether this path serves the call (cheap checks only; the kernel build is checked by :func:`attention`)."""
    if observer is not None or softcap or bias is not None or device != "cpu":
        return False
    if type(sparsifier) is Dense:
        return True
    if type(sparsifier) is SkipSoftmax:  # SDC exact or none: the other estimators need a calibrated θ
        return phase == "prefill" and lower(compensations, sparsifier.placement).sdc_mode in (0, 1)
    return (type(sparsifier) is TopTheta and phase == "prefill"
            and getattr(sparsifier, "empty_rows", "keep-max") == "keep-max")


def attention(
    query: torch.Tensor,  # (B, H, Q, D)
    key: torch.Tensor,  # (B, Hkv, K, D)
    value: torch.Tensor,  # (B, Hkv, K, Dv)
    valid: torch.Tensor | None,  # (B or 1, 1, Q, K) bool; None = causal, the queries being the last Q keys
    *,
    scaling: float,
    layer: int,
    sparsifier,
    compensations: Sequence = (),
    stats=None,
    observer=None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    phase: str | None = None,
    **_,
) -> torch.Tensor | None:
    """Attention output (B, Q, H, Dv) like ``kernel.sparse_attention``, or None where this path does not apply."""
    B, H, Q, D = query.shape
    Hkv, K = key.shape[1], key.shape[2]
    phase = phase or ("prefill" if Q > 1 else "decode")
    if not supports(sparsifier, compensations, observer=observer, softcap=softcap, bias=bias,
                    device=query.device.type, phase=phase):
        return None
    if (valid is None and K < Q) or K == 0 or H % Hkv:
        return None
    ext = fused_prefill.extension()
    if ext is None:
        return None
    skip = type(sparsifier) is SkipSoftmax
    sparse = skip or type(sparsifier) is TopTheta
    post = sparse and sparsifier.placement == "post"
    lowered = lower(compensations, sparsifier.placement if sparse else None)  # SDC: pre-softmax only
    vmc = lowered.vmc
    counting = stats is not None and stats.enabled

    n = rows = None
    if valid is None:  # row i has the keys 0..K−Q+i
        mask = _NO_MASK
        if sparse or counting:
            n = torch.arange(K - Q + 1, K + 1, device=query.device).expand(B, 1, Q)
    else:
        vm = valid.expand(B, 1, Q, K)
        n = vm.sum(-1)  # (B, 1, Q)
        mask = vm[:, 0]  # (B, Q, K), any strides
    if sparse or counting:
        rows = RowBlock(layer, phase, shape_only(B, H, Q, K, query.device), n)
    theta = offset = raw = cal = vbar = _EMPTY
    vmc_mode = 0
    if skip:  # ln(λ/n) per row (−inf: kept whole), what the compiled kernels cut at min(m + it, m) with
        offset = sparsifier.cut_offsets(layer, n).expand(B, H, Q).contiguous()
    elif sparse:
        theta, raw, rows.clamped_rows = row_thresholds_of(sparsifier, rows, cache=valid is None)
        mass = lowered.calibrated_mass(layer, n, sparsifier)  # (B, H|1, Q), None unless calibrated SDC
        if mass is not None:
            cal = mass.expand(B, H, Q).contiguous()
    if sparse:
        if vmc:  # v̄: float64 prefix means in the kernel when causal, else from the mask here (the same bits)
            vmc_mode = 2 if valid is None else 1
            if valid is not None:
                vbar = _value_means(value, valid, n)
    kf, vf = _slabs(key), _slabs(value)  # a growing cache's views read in place, not copied per layer
    q = (query.float() * scaling).contiguous()
    # Queries per task: enough tasks to balance the threads, and short blocks on short prompts (a causal block of
    # qb queries computes a qb × qb triangle in full; measured on 2 shared cores: qb = 16 beats 64 at 64-256 tokens).
    tasks_wanted = 2 * torch.get_num_threads()
    qb = max(16, min(MAX_QUERY_BLOCK, Q // 16, -(-B * Hkv * Q // tasks_wanted)))
    out, rowstats = ext.prefill(q, kf, vf, mask, theta, offset, raw, cal, vbar, vmc_mode,
                                lowered.sdc_mode, lowered.sdc_scale, qb, KEY_BLOCK, post)
    if counting:
        if sparse:
            rows.kept_counts = rowstats[..., 0].long()  # (B, H, Q)
            rows.kept_mass = rowstats[..., 1:2]  # (B, H, Q, 1)
            rows.empty = (sparsifier.empty_mask(rows) if skip  # λ > n: the cut is the maximum (as the plain kernel)
                          else rowstats[..., 2].bool() & (n > sparsifier.k_for(layer)))
        stats.update(rows)
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _slabs(x: torch.Tensor) -> torch.Tensor:
    """x (B, Hkv, K, D) as float32 with every (sequence, head) slab contiguous, what the kernel reads; a copy only
    where x is not already so (a KV cache's views into buffers with spare room are)."""
    x = x.float()
    slabs = x.stride(-1) == 1 and (x.stride(-2) == x.shape[-1] or x.shape[-2] == 1)
    return x if slabs else x.contiguous()


def row_thresholds_of(sparsifier: TopTheta, rows: RowBlock, cache: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(θ the kernel compares with, θ as calibrated, rows clamped), each (B, H, Q) float32 contiguous: the lowering
    every backend shares (``backends/call.py``); ``cache``: a causal call, whose lookups are memoised."""
    B, H, Q, K = rows.logits.shape
    return call.row_thresholds(sparsifier, rows.layer, rows.n, H, memo_k=K if cache else None)


_EMPTY = torch.empty(0)
_NO_MASK = torch.empty(0, dtype=torch.bool)


def shape_only(B: int, H: int, Q: int, K: int, device) -> torch.Tensor:
    """A (B, H, Q, K) stand-in for the logits, which this path never materialises (the statistics read the shape)."""
    return torch.zeros((), device=device).expand(B, H, Q, K)


def _value_means(value: torch.Tensor, valid: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """v̄ of every masked row: the mean V row over its valid keys (B, Hkv, Q, Dv) float32 (method.md §3.2).

    Causal rows need none of this: the kernel keeps float64 prefix sums. Here: float64 sums and exact division, as
    the kernel's causal prefix means, so a row's v̄ has the same float32 bits whichever way its valid keys are laid
    out (alone, left-padded in a batch, or packed after a cached context). The keys that every row of a sequence
    with a valid key sees (a cached context, which the rows after it share) are summed once per sequence; only the
    rest (the rows' own tokens) is summed per row: the sums are of float32 values in float64, exact in any order.
    """
    B, Hkv, K, Dv = value.shape
    Q = n.shape[-1]
    vd = value.double()
    vm = valid.expand(B, 1, Q, K)[:, 0]  # (B, Q, K)
    seen = n[:, 0] > 0  # (B, Q): rows with a valid key (the others get 0)
    common = (vm | ~seen[..., None]).all(1) & seen.any(1, keepdim=True)  # (B, K): keys every such row sees
    shared = common.double()[:, None, None, :] @ vd  # (B, Hkv, 1, Dv)
    own = vm & ~common[:, None, :]  # (B, Q, K)
    cols = own.any(1).any(0).nonzero().squeeze(1)  # keys some row sees beyond the common ones
    vo = vd[:, :, cols]  # (B, Hkv, C, Dv)
    out = value.new_empty(B, Hkv, Q, Dv, dtype=torch.float32)
    step = max(1, (1 << 21) // max(1, B * len(cols)))  # rows per chunk: ~16 MB of float64 mask
    for a in range(0, Q, step):
        b = min(Q, a + step)
        sums = own[:, None, a:b][..., cols].double() @ vo + shared  # (B, Hkv, b − a, Dv)
        sums = sums.where(seen[:, None, a:b, None], 0.0)
        out[:, :, a:b] = (sums / n[..., a:b].clamp_min(1).unsqueeze(-1)).float()
    return out
