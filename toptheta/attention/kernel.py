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

DEFAULT_CHUNK_ELEMENTS = 1 << 23  # score elements per chunk: 32 MB per float32 temporary


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

    kf, vf = key.float(), value.float()  # no-ops for float32 models
    out = query.new_zeros(B, Q, H, Dv)
    rows_per_chunk = chunk_size or max(1, DEFAULT_CHUNK_ELEMENTS // (B * H * K))
    for q0 in range(0, Q, rows_per_chunk):
        q1 = min(Q, q0 + rows_per_chunk)
        vm = _chunk_mask(valid, q0, q1, B, Q, K, query.device)  # (B, 1, Qc, K)
        cols = vm.any(dim=(0, 1, 2)).nonzero()
        if cols.numel() == 0:  # only fully masked rows (e.g. queries on padding): output 0
            continue
        ks, ke = int(cols[0]), int(cols[-1]) + 1
        vm = vm[..., ks:ke]  # (B, 1, Qc, Kc)
        Qc, Kc = q1 - q0, ke - ks

        q = query[:, :, q0:q1].float().view(B, Hkv, G, Qc, D)
        s = (q @ kf[:, :, None, ks:ke].transpose(-1, -2)).view(B, H, Qc, Kc) * scaling  # (B, H, Qc, Kc)
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            s = s + bias[:, :, q0:q1, ks:ke].float()
        s = s.masked_fill(~vm, float("-inf"))
        n = vm.sum(-1)  # (B, 1, Qc)
        m = s.amax(-1, keepdim=True)  # (B, H, Qc, 1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)  # (B, H, Qc, Kc), 0 where invalid
        rows = RowBlock(layer=layer, phase=phase, logits=s, exp_scores=e, row_sum=e.sum(-1, keepdim=True),
                        row_max=m, valid=vm, n=n)
        rows.keep = keep = sparsifier.select(rows)
        if observer is not None:
            observer(rows)

        tiny = torch.finfo(torch.float32).tiny
        if keep is None:
            w = rows.probs
        elif sparsifier.placement == "post":  # zero the dropped probabilities, no renormalisation
            w = rows.probs.masked_fill(~keep, 0.0)
        else:  # pre-softmax: renormalise over the kept set, SDC adds the dropped mass back
            ek = e.masked_fill(~keep, 0.0)
            denom = ek.sum(-1, keepdim=True)
            if sdc is not None:
                denom = denom + sdc.dropped_mass(rows, e, keep, sparsifier)
            w = ek / denom.clamp_min(tiny)

        o = w.view(B, Hkv, G, Qc, Kc) @ vf[:, :, None, ks:ke]  # (B, Hkv, G, Qc, Dv)
        if vmc and keep is not None:
            beta = 1.0 - w.sum(-1)  # (B, H, Qc) missing mass, in float32
            beta = beta.masked_fill(n.expand_as(beta) == 0, 0.0)
            v_mean = (vm.float() @ vf[:, :, ks:ke]) / n.clamp_min(1).unsqueeze(-1)  # (B, Hkv, Qc, Dv)
            o = o + beta.view(B, Hkv, G, Qc, 1) * v_mean[:, :, None]
        out[:, q0:q1] = o.reshape(B, H, Qc, Dv).transpose(1, 2).to(out.dtype)
        if stats is not None:
            stats.update(rows)
    return out


def _chunk_mask(valid, q0: int, q1: int, B: int, Q: int, K: int, device) -> torch.Tensor:
    """Rows q0:q1 of the mask; with no mask, causal with the queries as the last Q keys (built per chunk,
    so a long prefill never holds a Q×K mask)."""
    if valid is not None:
        return valid[:, :, q0:q1]
    rows = torch.arange(q0, q1, device=device)[:, None] + (K - Q)  # absolute position of each query
    return (torch.arange(K, device=device)[None, :] <= rows)[None, None].expand(B, 1, q1 - q0, K)
