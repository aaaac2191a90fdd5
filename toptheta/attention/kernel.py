"""The sparse attention kernel: chunked over queries, float32 statistics, any sparsifier.

Pure torch, no transformers imports: ``backend.py`` adapts it to transformers' attention interface.
Queries are processed in chunks of rows, so the extra memory is O(B·H·chunk·K) instead of the
O(B·H·Q·K) score matrix eager attention builds. Within a chunk, keys that no row of the chunk may
attend to (the causal future, or keys outside a sliding window) are cut away first, which halves
the work of a causal prefill.

Per row (method.md §1-3): logits s = q·k·scale (+ softcap), m = max valid s, e = exp(s − m),
then
    dense / post-softmax:  w = p·[kept],  p = softmax(s)        (torch's fused softmax; no renormalisation)
    pre-softmax:           w = e·[kept] / (Σ_kept e + λ·E)     (E = 0 without SDC)
    output:                o = Σ w·v  (+ β·v̄ with VMC, β = 1 − Σ w, v̄ = mean V over valid keys)

Speed comes from doing as few passes over a chunk's (Qc, Kc) scores as possible: two GEMMs, the
softmax, one comparison (the sparsifier), one in-place zeroing and one row sum. Chunks of ~1M scores
(4 MB per float32 temporary) stay in the cache between those passes. For post-softmax thresholds in
prefill, ``fused.py`` (an optional C++ kernel, built on first use) replaces everything between the two
GEMMs with one pass per row (the ``cpu-select`` backend); the torch path stays the reference and the fallback.

``sparse_attention`` is the entry point: it lowers the call once (``backends/call.py``) and hands it to the
backend registry (``backends/``), whose ``plain`` backend is :func:`plain_attention` below. Off the CPU the plain
kernel reads no tensor value on the host: a masked chunk keeps the whole key window instead of finding its
first and last valid key, and chunks hold ``ACCELERATOR_CHUNK_ELEMENTS`` scores.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from . import backends, fused
from .backends.call import AttentionCall
from ..sparsifiers.base import RowBlock, Sparsifier

# Score elements per chunk. A small budget keeps each float32 temporary near cache size (4 MB) and lowers the
# peak memory of long prefills; but a chunk of very few rows re-reads all of K and V for little work, so a
# chunk gets at least MIN_CHUNK_ROWS rows as long as that stays under MAX_CHUNK_ELEMENTS (32 MB temporaries).
DEFAULT_CHUNK_ELEMENTS = 1 << 20
MIN_CHUNK_ROWS = 16
MAX_CHUNK_ELEMENTS = 1 << 23
ACCELERATOR_CHUNK_ELEMENTS = 1 << 27  # scores per chunk off the CPU (see default_rows_per_chunk)


def sparse_attention(
    query: torch.Tensor,  # (B, H, Q, D)
    key: torch.Tensor,  # (B, Hkv, K, D)
    value: torch.Tensor,  # (B, Hkv, K, Dv)
    valid: torch.Tensor | None,  # (B or 1, 1, Q, K) bool; None = causal, the queries being the last Q keys (the
    # backend passes None only when the cache says so: upper-left alignment, e.g. a static cache, comes as a mask)
    *,
    scaling: float,
    layer: int,
    sparsifier: Sparsifier,
    compensations: Sequence = (),
    stats=None,
    observer: Callable[[RowBlock], None] | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,  # (B or 1, 1 or H, Q, K) additive float bias, rarely used
    phase: str | None = None,
) -> torch.Tensor:
    """Attention output (B, Q, H, Dv) in the query's dtype (transformers' layout).

    ``phase`` ("prefill" or "decode") is what the model is doing, for the statistics; the backend knows it (the
    steps of ``generate`` after the prompt are decode). None: decode when Q == 1, for direct callers.
    The call is lowered once (``backends/call.py``) and run by the first backend of the registry that serves it
    (``backends/``: the C++ and Triton fast paths, sdpa for dense attention on accelerators, and this module's
    :func:`plain_attention`, the reference, which serves every call).
    """
    B, H, Q, D = query.shape
    phase = phase or ("prefill" if Q > 1 else "decode")
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    if H % key.shape[1]:
        raise ValueError(f"{H} query heads are not a multiple of {key.shape[1]} KV heads")
    call = AttentionCall(query, key, value, valid, scaling, layer, sparsifier, tuple(compensations or ()), stats,
                         observer, chunk_size, softcap, bias, phase)
    return backends.dispatch(call)


def plain_attention(call: AttentionCall, fuse: bool = False) -> torch.Tensor:
    """The reference: chunks of query rows, torch ops, the sparsifier's ``select`` (module docstring).

    ``fuse``: post-softmax selection in the C++ kernel of ``fused.py`` where the sparsifier offers a rule (CPU
    tensors only; the ``cpu-select`` backend). On accelerators nothing here reads a tensor's value on the host:
    chunks keep the whole key window and the statistics stay on the device.
    """
    query, key, value, valid = call.query, call.key, call.value, call.valid
    scaling, layer, sparsifier, stats, observer = call.scaling, call.layer, call.sparsifier, call.stats, call.observer
    softcap, bias, phase = call.softcap, call.bias, call.phase
    B, H, Q, D = query.shape
    Hkv, K, Dv = key.shape[1], key.shape[2], value.shape[-1]
    G = H // Hkv
    if valid is not None:
        valid = valid.expand(B, 1, Q, K)
    sdc, vmc = call.sdc, call.vmc
    pre = sparsifier.placement == "pre"
    counting = call.counting
    host = query.device.type == "cpu"  # reading values on the host is free here, a synchronisation elsewhere
    fuse = fuse and host and not pre and phase == "prefill" and observer is None

    kf, vf = key.float().contiguous(), value.float().contiguous()
    zero = vf.new_zeros(())
    out = query.new_zeros(B, Q, H, Dv)
    rows_per_chunk = call.chunk_size or default_rows_per_chunk(B * H * K, query.device)
    tiny = torch.finfo(torch.float32).tiny
    causal = valid is None and K >= Q  # keys 0..K-Q+row: a chunk's keys are a prefix, its mask a triangle
    if causal:  # the last Qc keys of a causal chunk form the same upper triangle in every chunk
        size = min(rows_per_chunk, Q)
        future = torch.ones(size, size, dtype=torch.bool, device=query.device).triu_(1)
    v_sum, v_end = None, 0  # causal VMC: running float64 sum of V over keys [0, v_end)
    for q0 in range(0, Q, rows_per_chunk):
        q1 = min(Q, q0 + rows_per_chunk)
        Qc = q1 - q0
        if causal:
            ks, ke = 0, K - Q + q1
            n = torch.arange(K - Q + q0 + 1, ke + 1, device=query.device).expand(B, 1, Qc)
            vm = functools.partial(_causal_mask, B, K - Q + q0, Qc, ke, query.device)  # built only if asked for
        else:
            vm = valid[:, :, q0:q1]  # (B, 1, Qc, K)
            ks, ke = 0, K  # accelerators: the whole window (finding the used keys is a host read)
            if host:
                cols = vm.any(dim=(0, 1, 2)).nonzero()
                if cols.numel() == 0:  # only fully masked rows (e.g. queries on padding): output 0
                    continue
                ks, ke = int(cols[0]), int(cols[-1]) + 1
                vm = vm[..., ks:ke]  # (B, 1, Qc, Kc)
            n = vm.sum(-1)  # (B, 1, Qc)
        Kc = ke - ks

        # The G heads of a KV head stacked as G·Qc rows, scaled: a small copy (the scale costs a pass in the GEMM).
        q = (query[:, :, q0:q1].float() * scaling).reshape(B * Hkv, G * Qc, D)
        k_t = kf[:, :, ks:ke].transpose(-1, -2).reshape(B * Hkv, D, Kc)  # a view
        s = torch.bmm(q, k_t).view(B, H, Qc, Kc)
        if softcap:
            s.div_(softcap).tanh_().mul_(softcap)
        if bias is not None:
            s.add_(bias[:, :, q0:q1, ks:ke].float())
        if causal:  # only the last Qc keys of a causal chunk can be masked for some of its rows
            s[..., Kc - Qc:].masked_fill_(future[:Qc, :Qc], float("-inf"))
        else:
            s.masked_fill_(~vm, float("-inf"))

        done = None  # (kept_sum, counts, empty rows) when the fused kernel did the selection
        if pre:  # selection on logits; weights exp(s − m) / denominator
            m = s.amax(-1, keepdim=True)  # (B, H, Qc, 1)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            rows = RowBlock(layer, phase, s, n, valid=vm, exp_scores=torch.sub(s, m).exp_(), row_max=m)
        else:  # dense and post-softmax: weights are the dense probabilities, zeroed where dropped
            rows = RowBlock(layer, phase, s, n, valid=vm)
            # Fused path: softmax, threshold, zeroing and kept sums in one C++ pass (None where unavailable).
            rule = sparsifier.fused_rule(rows) if fuse else None
            done = fused.post_select(s, rule) if rule is not None else None
            if done is None:
                p = torch.softmax(s, dim=-1)
                if not causal:  # rows with no valid key: softmax of all -inf is NaN, their output is 0
                    dead = (n == 0).unsqueeze(-1)  # (B, 1, Qc, 1)
                    if not host or bool(dead.any()):
                        p.masked_fill_(dead, 0.0)
                rows._probs = p
        if done is not None:  # s now holds the kept weights
            kept_sum, counts, rows.empty = done
            rows.kept_counts = torch.where(rule.whole, n, counts)  # whole rows keep their n valid keys
            rows.keep = keep = None
        else:
            rows.want_next = getattr(observer, "wants_next_index", False)
            rows.keep = keep = sparsifier.select(rows)
            if observer is not None:
                observer(rows)

        v = vf[:, :, ks:ke].reshape(B * Hkv, Kc, Dv)  # a view
        sparse = done is not None or keep is not None
        denom = None  # post-softmax: no renormalisation, the kept weights are dense probabilities
        uniform = None  # (B, H, Qc) rows given the reference code's uniform attention
        if done is not None:
            o = torch.bmm(s.view(B * Hkv, G * Qc, Kc), v).view(B, H, Qc, Dv)
            rows.kept_mass = kept_sum
        elif keep is None:  # dense
            w = rows.probs if not pre else rows.exp_scores
            o = torch.bmm(w.view(B * Hkv, G * Qc, Kc), v).view(B, H, Qc, Dv)
            if pre:
                o = o / rows.row_sum.clamp_min(tiny)
        else:
            # Kept weights ek (exp scores or probabilities; in place when nobody else reads them any more).
            e = rows.exp_scores if pre else rows.probs
            ek = torch.where(keep, e, zero, out=e) if (observer is None and not pre) else torch.where(keep, e, zero)
            o = torch.bmm(ek.reshape(B * Hkv, G * Qc, Kc), v).view(B, H, Qc, Dv)
            kept_sum = ek.sum(-1, keepdim=True)  # (B, H, Qc, 1) Σ kept weights
            if pre:  # renormalise over the kept set; SDC adds (an estimate of) the dropped mass back
                denom = kept_sum if sdc is None else kept_sum + sdc.dropped_mass(rows, kept_sum, sparsifier)
                denom = denom.clamp_min(tiny)
                o = o / denom
                if sdc is None and getattr(sparsifier, "empty_rows", None) == "reference" and rows.empty is not None:
                    o = _uniform_over_padded_row(o, rows.empty, vf)
                    uniform = rows.empty  # these rows now attend with weights summing to 1: nothing is missing
                if counting:
                    rows.kept_mass = kept_sum / rows.row_sum.clamp_min(tiny)
            else:
                rows.kept_mass = kept_sum
        if sparse:
            if vmc:
                beta = 1.0 - (kept_sum if denom is None else kept_sum / denom)  # (B, H, Qc, 1) missing mass
                beta = beta.masked_fill(n.unsqueeze(-1) == 0, 0.0)
                if uniform is not None:
                    beta = beta.masked_fill(uniform.unsqueeze(-1), 0.0)
                if causal:  # v̄ of row i is the mean of the V prefix: running sums, no (Qc, Kc) matmul
                    if v_sum is None:
                        v_sum = vf.new_zeros(B, Hkv, 1, Dv, dtype=torch.float64)
                    prefix = vf[:, :, v_end:ke].double().cumsum(2).add_(v_sum)  # sums over keys [0, j]
                    v_sum, v_end = prefix[:, :, -1:], ke
                    v_mean = (prefix[:, :, -Qc:] / n.unsqueeze(-1).clamp_min(1)).float()  # (B, Hkv, Qc, Dv)
                else:
                    v_mean = (vm.float() @ vf[:, :, ks:ke]) / n.clamp_min(1).unsqueeze(-1)  # (B, Hkv, Qc, Dv)
                o = o.view(B, Hkv, G, Qc, Dv) + beta.view(B, Hkv, G, Qc, 1) * v_mean[:, :, None]
        out[:, q0:q1] = o.reshape(B, H, Qc, Dv).transpose(1, 2).to(out.dtype)
        if counting:
            stats.update(rows)
    return out


def default_rows_per_chunk(row_elements: int, device=None) -> int:
    """Query rows per chunk when the caller gives none; ``row_elements`` = B·H·K scores per query row.

    On an accelerator a chunk is a budget of elements (ACCELERATOR_CHUNK_ELEMENTS, 512 MB float32 temporaries):
    each chunk costs kernel launches, not cache misses, so a 4k prefill is one chunk."""
    if device is not None and torch.device(device).type != "cpu":
        return max(1, ACCELERATOR_CHUNK_ELEMENTS // row_elements)
    return max(1, DEFAULT_CHUNK_ELEMENTS // row_elements, min(MIN_CHUNK_ROWS, MAX_CHUNK_ELEMENTS // row_elements))


def _uniform_over_padded_row(o: torch.Tensor, empty: torch.Tensor, vf: torch.Tensor) -> torch.Tensor:
    """The reference code's empty pre-softmax rows (method.md §9, 10a; ``TopTheta(empty_rows="reference")``).

    Every logit of such a row, valid or not, became the dtype minimum, so its softmax is uniform over all K keys
    of the call, the causal future included. o (B, H, Qc, Dv), empty (B, H, Qc) bool, vf (B, Hkv, K, Dv).
    """
    if empty.device.type == "cpu" and not bool(empty.any()):
        return o
    H, Hkv = o.shape[1], vf.shape[1]
    v_all = vf.mean(2).repeat_interleave(H // Hkv, 1)[:, :, None]  # (B, H, 1, Dv)
    return torch.where(empty.unsqueeze(-1), v_all, o)


def _causal_mask(B: int, first: int, Qc: int, Kc: int, device) -> torch.Tensor:
    """(B, 1, Qc, Kc) causal mask of a chunk whose first query sits at absolute position ``first``."""
    rows = torch.arange(first, first + Qc, device=device)[:, None]
    return (torch.arange(Kc, device=device)[None, :] <= rows)[None, None].expand(B, 1, Qc, Kc)
