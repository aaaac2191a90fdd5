"""The sparse attention kernel: chunked over queries, float32 statistics, any sparsifier.

Pure torch, no transformers imports: ``backend.py`` adapts it to transformers' attention interface.
Queries are processed in chunks of rows, so the extra memory is O(B·H·chunk·K) instead of the
O(B·H·Q·K) score matrix eager attention builds. Within a chunk, keys that no row of the chunk may
attend to (the causal future, or keys outside a sliding window) are cut away first, which halves
the work of a causal prefill.

Per row (method.md §1-3): logits s = q·k·scale (+ softcap), m = max valid s, e = exp(s − m),
then
    dense / post-softmax:  w = e·[kept] / Σ_valid e
    pre-softmax:           w = e·[kept] / (Σ_kept e + λ·E)     (E = 0 without SDC)
    output:                o = Σ w·v  (+ β·v̄ with VMC, β = 1 − Σ w, v̄ = mean V over valid keys)
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..compensation import SDC, VMC
from ..sparsifiers.base import RowBlock, Sparsifier

# Score elements per chunk. A small budget keeps each float32 temporary near cache size (8 MB) and lowers the
# peak memory of long prefills; but a chunk of very few rows re-reads all of K and V for little work, so a
# chunk gets at least MIN_CHUNK_ROWS rows as long as that stays under MAX_CHUNK_ELEMENTS (32 MB temporaries).
DEFAULT_CHUNK_ELEMENTS = 1 << 21
MIN_CHUNK_ROWS = 16
MAX_CHUNK_ELEMENTS = 1 << 23


def sparse_attention(
    query: torch.Tensor,  # (B, H, Q, D)
    key: torch.Tensor,  # (B, Hkv, K, D)
    value: torch.Tensor,  # (B, Hkv, K, Dv)
    valid: torch.Tensor | None,  # (B or 1, 1, Q, K) bool; None = causal, the queries being the last Q keys
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
) -> torch.Tensor:
    """Attention output (B, Q, H, Dv) in the query's dtype (transformers' layout)."""
    B, H, Q, D = query.shape
    Hkv, K, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    G = H // Hkv
    if valid is not None:
        valid = valid.expand(B, 1, Q, K)
    sdc = next((c for c in compensations if isinstance(c, SDC)), None)
    vmc = any(isinstance(c, VMC) for c in compensations)
    phase = "prefill" if Q > 1 else "decode"

    # One contiguous float32 copy of K/V at most (no-ops for contiguous float32 inputs), so every chunk's
    # matmul is a strided view: the G query heads of a KV head are stacked as G·Qc rows of one bmm.
    kf, vf = key.float().contiguous(), value.float().contiguous()
    out = query.new_zeros(B, Q, H, Dv)
    rows_per_chunk = chunk_size or default_rows_per_chunk(B * H * K)
    tiny = torch.finfo(torch.float32).tiny
    causal = valid is None and K >= Q  # keys 0..K-Q+row: a chunk's keys are a prefix, its mask a triangle
    v_sum, v_end = None, 0  # causal VMC: running float64 sum of V over keys [0, v_end)
    for q0 in range(0, Q, rows_per_chunk):
        q1 = min(Q, q0 + rows_per_chunk)
        Qc = q1 - q0
        vm = _chunk_mask(valid, q0, q1, B, Q, K, query.device)  # (B, 1, Qc, K)
        if causal:
            ks, ke = 0, K - Q + q1
        else:
            cols = vm.any(dim=(0, 1, 2)).nonzero()
            if cols.numel() == 0:  # only fully masked rows (e.g. queries on padding): output 0
                continue
            ks, ke = int(cols[0]), int(cols[-1]) + 1
        vm = vm[..., ks:ke]  # (B, 1, Qc, Kc)
        Kc = ke - ks

        q = query[:, :, q0:q1].float().reshape(B * Hkv, G * Qc, D)  # the G heads of a KV head stacked: a small copy
        k_t = kf[:, :, ks:ke].transpose(-1, -2).reshape(B * Hkv, D, Kc)  # a view
        s = torch.baddbmm(q.new_empty(()), q, k_t, beta=0.0, alpha=scaling).view(B, H, Qc, Kc)  # scaled in the GEMM
        if softcap:
            s.div_(softcap).tanh_().mul_(softcap)
        if bias is not None:
            s.add_(bias[:, :, q0:q1, ks:ke].float())
        if causal:  # only the last Qc keys of a causal chunk can be masked for some of its rows
            t0 = max(0, Kc - Qc)
            s[..., t0:].masked_fill_(~vm[..., t0:], float("-inf"))
        else:
            s.masked_fill_(~vm, float("-inf"))
        n = vm.sum(-1)  # (B, 1, Qc)
        m = s.amax(-1, keepdim=True)  # (B, H, Qc, 1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.sub(s, m).exp_()  # (B, H, Qc, Kc), 0 where invalid
        row_sum = e.sum(-1, keepdim=True)
        rows = RowBlock(layer=layer, phase=phase, logits=s, exp_scores=e, row_sum=row_sum,
                        row_max=m, valid=vm, n=n)
        rows.keep = keep = sparsifier.select(rows)
        if observer is not None:
            observer(rows)

        # w = ek / denom with ek = e·[kept]; the division is applied to the (Qc, Dv) output rows instead of
        # the (Qc, Kc) weights. e and the cached probabilities stay untouched (statistics read them).
        ek = e if keep is None else torch.where(keep, e, 0.0)
        kept_sum = None
        if keep is None or sparsifier.placement == "post":  # dense, or no renormalisation
            denom = row_sum
        else:  # pre-softmax: renormalise over the kept set, SDC adds the dropped mass back
            denom = kept_sum = ek.sum(-1, keepdim=True)
            if sdc is not None:
                denom = denom + sdc.dropped_mass(rows, e, keep, sparsifier)
        denom = denom.clamp_min(tiny)  # (B, H, Qc, 1)

        o = torch.bmm(ek.view(B * Hkv, G * Qc, Kc), vf[:, :, ks:ke].reshape(B * Hkv, Kc, Dv)).view(B, H, Qc, Dv)
        o.div_(denom)
        if vmc and keep is not None:
            if kept_sum is None:
                kept_sum = ek.sum(-1, keepdim=True)
            beta = 1.0 - kept_sum / denom  # (B, H, Qc, 1) missing mass, in float32
            beta = beta.masked_fill(n.unsqueeze(-1).expand_as(beta) == 0, 0.0)
            if causal:  # v̄ of row i is the mean of the V prefix: running sums, no (Qc, Kc) matmul
                if v_sum is None:
                    v_sum = vf.new_zeros(B, Hkv, 1, Dv, dtype=torch.float64)
                prefix = vf[:, :, v_end:ke].double().cumsum(2).add_(v_sum)  # sums over keys [0, j]
                v_sum, v_end = prefix[:, :, -1:], ke
                v_mean = (prefix[:, :, -Qc:] / n.unsqueeze(-1).clamp_min(1)).float()  # (B, Hkv, Qc, Dv)
            else:
                v_mean = (vm.float() @ vf[:, :, ks:ke]) / n.clamp_min(1).unsqueeze(-1)  # (B, Hkv, Qc, Dv)
            o.view(B, Hkv, G, Qc, Dv).add_(beta.view(B, Hkv, G, Qc, 1) * v_mean[:, :, None])
        out[:, q0:q1] = o.transpose(1, 2).to(out.dtype)
        if stats is not None:
            stats.update(rows)
    return out


def default_rows_per_chunk(row_elements: int) -> int:
    """Query rows per chunk when the caller gives none; ``row_elements`` = B·H·K scores per query row."""
    return max(1, DEFAULT_CHUNK_ELEMENTS // row_elements, min(MIN_CHUNK_ROWS, MAX_CHUNK_ELEMENTS // row_elements))


def _chunk_mask(valid, q0: int, q1: int, B: int, Q: int, K: int, device) -> torch.Tensor:
    """Rows q0:q1 of the mask; with no mask, causal with the queries as the last Q keys (built per chunk,
    so a long prefill never holds a Q×K mask)."""
    if valid is not None:
        return valid[:, :, q0:q1]
    rows = torch.arange(q0, q1, device=device)[:, None] + (K - Q)  # absolute position of each query
    return (torch.arange(K, device=device)[None, :] <= rows)[None, None].expand(B, 1, q1 - q0, K)
