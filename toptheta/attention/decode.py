"""Sparse decode: one query row per sequence over a KV cache, reading only the V rows someone kept.

The fast path of ``kernel.sparse_attention`` for Q == 1 (cached decoding, batch ≥ 1, GQA). It computes the
same logits, runs the same sparsifier on the same :class:`RowBlock` and applies SDC and VMC with the same
formulas, so keep decisions and statistics are identical to the plain kernel; only the output is computed
differently (method.md §1-3):

* V is read only at the kept rows: per sequence and KV head, the union over its G query heads (the kept
  V rows the paper counts). Each (sequence, KV head) gets its rows gathered into a zero-padded block and
  one batched GEMM does Σ w·v. Where the union is most of the window, one dense GEMM is cheaper.
* VMC's v̄ (the mean of all valid V rows) comes from a running float64 sum kept per layer beside the
  cache: each step adds only the new rows. The sum is trusted only while the cache grows as expected
  (the window did not shrink, the prefix's valid-key counts and its last V row are unchanged); after a
  crop or an edit it is recomputed from the whole cache once. (A cache reordered between steps, as in
  beam search, whose rows at the previous last position happen to be equal would fool the check.)
* A bfloat16/float16 cache is never copied to float32 as a whole: K is converted in blocks of
  ``BLOCK_KEYS`` for the logits GEMM, and only the gathered V rows are converted.
* Top-θ (either placement, SDC, VMC) and dense decoding of a float32 cache run in one C++ kernel
  (``fused_decode.py``): K read once, V rows read only where a head of the group keeps them, the statistics
  reported by the kernel. Top-k, observers, soft-capping, biases and low-precision caches use the torch ops
  below, which stay the reference.

Set ``TOPTHETA_FAST=0`` (or ``decode.ENABLED = False``) to use the plain kernel; tests compare the two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..compensation import lower
from ..sparsifiers import Dense, TopTheta
from ..sparsifiers.base import RowBlock, Sparsifier
from . import fused_decode, prefill

ENABLED = os.environ.get("TOPTHETA_FAST", "1") != "0"
BLOCK_KEYS = 8192  # keys per float32 conversion block of a low-precision cache (~2-4 MB temporaries)
DENSE_ABOVE = 0.5  # gather kept V rows only while the largest union holds at most this fraction of the window
MIN_KEYS_PER_TASK = 512  # the C++ kernel's key blocks (fused_decode.py): at least this many keys each
TASK_K_BYTES = 1 << 18  # and at most this many bytes of K each (a task's logits and keep flags stay in L2)


@dataclass
class _VSum:
    """Σ of the valid V rows over absolute key positions [0, upto) of one layer's cache."""

    upto: int
    total: torch.Tensor  # (B, Hkv, Dv) float64
    count: torch.Tensor | None  # (B,) valid keys in [0, upto); None: every key (a decode row without a mask)
    last: torch.Tensor  # (B, Hkv, Dv) V row at position upto − 1, to notice an edited cache


# (layer, B, Hkv, Dv, dtype, device) -> running sum. One entry per layer of whatever model decodes.
_VSUMS: dict[tuple, _VSum] = {}


def attention(
    query: torch.Tensor,  # (B, H, 1, D)
    key: torch.Tensor,  # (B, Hkv, K, D)
    value: torch.Tensor,  # (B, Hkv, K, Dv)
    valid: torch.Tensor | None,  # (B or 1, 1, 1, K) bool; None = every key (the query is the last key)
    *,
    scaling: float,
    layer: int,
    sparsifier: Sparsifier,
    compensations: Sequence = (),
    stats=None,
    observer: Callable[[RowBlock], None] | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    fused: bool = True,
    **_,
) -> torch.Tensor | None:
    """Attention output (B, 1, H, Dv) like ``kernel.sparse_attention``, or None where this path does not apply.

    ``fused``: try the C++ kernel first (the ``cpu-decode`` backend); False: the torch ops only (``torch-decode``)."""
    B, H, Q, D = query.shape
    Hkv, K, Dv = key.shape[1], key.shape[2], value.shape[-1]
    if Q != 1 or H % Hkv or K == 0 or getattr(sparsifier, "empty_rows", "keep-max") != "keep-max":
        return None  # (the reference code's empty-row rule is the plain kernel's: kernel._uniform_over_padded_row)
    G, R = H // Hkv, B * Hkv
    lowered = lower(compensations, sparsifier.placement)  # SDC: pre-softmax only; nothing for dense
    sdc, vmc = lowered.sdc, lowered.vmc
    pre = sparsifier.placement == "pre"

    if valid is None:  # the query is the last key: every key is valid
        ks, ke = 0, K
        n = torch.full((B, 1, 1), K, dtype=torch.long, device=query.device)
        vm = _AllValid(B, K, query.device)
        valid_row = None
    else:
        valid_row = valid.expand(B, 1, 1, K)[:, 0, 0]  # (B, K)
        cols = valid_row.any(0).nonzero()
        if cols.numel() == 0:  # only queries on padding: output 0, nothing counted (as the plain kernel)
            return query.new_zeros(B, 1, H, Dv)
        ks, ke = int(cols[0]), int(cols[-1]) + 1
        vm = valid.expand(B, 1, 1, K)[..., ks:ke]  # (B, 1, 1, Kc)
        n = vm.sum(-1)  # (B, 1, 1)
    Kc = ke - ks
    if fused and observer is None and not softcap and bias is None and type(sparsifier) in (TopTheta, Dense):
        done = _fused(query, key[:, :, ks:ke], value, valid_row, n, ks, ke, scaling=scaling, layer=layer,
                      sparsifier=sparsifier, lowered=lowered, stats=stats)
        if done is not None:
            return done

    out = query.new_zeros(B, 1, H, Dv)
    q = (query.float() * scaling).reshape(R, G, D)  # the G heads of a KV head as G rows of one bmm
    s = _logits(q, key[:, :, ks:ke]).view(B, H, 1, Kc)  # (B, H, 1, Kc) float32
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        s.add_(bias[..., ks:ke].float())
    if valid is not None:
        s.masked_fill_(~vm, float("-inf"))

    if pre:  # the plain kernel's row quantities, op for op, so the sparsifier sees identical numbers
        m = s.amax(-1, keepdim=True)  # (B, H, 1, 1)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        rows = RowBlock(layer, "decode", s, n, valid=vm, exp_scores=torch.sub(s, m).exp_(), row_max=m)
    else:
        rows = RowBlock(layer, "decode", s, n, valid=vm)
        p = torch.softmax(s, dim=-1)
        if valid is not None:
            dead = (n == 0).unsqueeze(-1)  # (B, 1, 1, 1)
            if bool(dead.any()):
                p.masked_fill_(dead, 0.0)
        rows._probs = p
    rows.want_next = getattr(observer, "wants_next_index", False)
    rows.keep = keep = sparsifier.select(rows)
    if observer is not None:
        observer(rows)

    tiny = torch.finfo(torch.float32).tiny
    if keep is None:  # dense: every valid V row is read
        w = rows.exp_scores if pre else rows.probs
        o = _weighted_sum(w.reshape(R, G, Kc), value[:, :, ks:ke]).view(B, H, 1, Dv)
        if pre:
            o = o / rows.row_sum.clamp_min(tiny)
    else:
        e = rows.exp_scores if pre else rows.probs
        ek = torch.where(keep, e, e.new_zeros(()))  # (B, H, 1, Kc) kept weights
        kept_sum = ek.sum(-1, keepdim=True)  # (B, H, 1, 1)
        o = _kept_rows_sum(ek.reshape(R, G, Kc), keep.reshape(R, G, Kc), value, ks).view(B, H, 1, Dv)
        denom = None
        if pre:  # renormalise over the kept set; SDC adds (an estimate of) the dropped mass back
            denom = kept_sum if sdc is None else kept_sum + sdc.dropped_mass(rows, kept_sum, sparsifier)
            denom = denom.clamp_min(tiny)
            o = o / denom
            if stats is not None and stats.enabled:
                rows.kept_mass = kept_sum / rows.row_sum.clamp_min(tiny)
        else:
            rows.kept_mass = kept_sum
        if vmc:
            beta = 1.0 - (kept_sum if denom is None else kept_sum / denom)  # (B, H, 1, 1) missing mass
            beta = beta.masked_fill(n.unsqueeze(-1) == 0, 0.0)
            v_mean = _running_mean(layer, value, valid_row, ke, n)  # (B, Hkv, 1, Dv)
            o = o.view(B, Hkv, G, 1, Dv) + beta.view(B, Hkv, G, 1, 1) * v_mean[:, :, None]
    out[:, 0] = o.reshape(B, H, Dv).to(out.dtype)
    if stats is not None and stats.enabled:
        stats.update(rows)
    return out


def _fused(query, key, value, valid_row, n, ks: int, ke: int, *, scaling: float, layer: int, sparsifier, lowered,
           stats) -> torch.Tensor | None:
    """Top-θ and dense decode in the C++ kernel (``fused_decode.py``); None where it does not apply (a float16 or
    bfloat16 cache, no compiler). ``key`` is the window [ks, ke); ``value`` the whole cache (v̄ reads it)."""
    B, H, _, D = query.shape
    Hkv, Kc = key.shape[1], key.shape[2]
    window = value[:, :, ks:ke]
    if key.dtype != torch.float32 or value.dtype != torch.float32 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    if any(t.device.type != "cpu" for t in (query, key, value)):  # a CPU kernel: never another device's pointers
        return None
    ext = fused_decode.extension()
    if ext is None:
        return None
    sparse = type(sparsifier) is TopTheta
    post = sparse and sparsifier.placement == "post"
    rows = RowBlock(layer, "decode", prefill.shape_only(B, H, 1, Kc, query.device), n)
    theta = raw = cal = vbar = prefill._EMPTY
    if sparse:
        theta, raw, rows.clamped_rows = prefill.row_thresholds_of(sparsifier, rows, cache=valid_row is None)
        theta, raw = theta.view(B, H), raw.view(B, H)
        mass = lowered.calibrated_mass(layer, n, sparsifier)  # (B, H|1, 1), None unless calibrated SDC
        if mass is not None:
            cal = mass.expand(B, H, 1).reshape(B, H).contiguous()
        if lowered.vmc:
            vbar = _running_mean(layer, value, valid_row, ke, n).reshape(B, Hkv, -1).contiguous()
    valid = valid_row[:, ks:ke].contiguous() if valid_row is not None else prefill._NO_MASK
    # Keys per task: about four tasks per thread, so one sequence with three KV heads still fills the threads.
    blocks = -(-4 * torch.get_num_threads() // (B * Hkv))
    # At most TASK_K_BYTES of K per task (since the G heads share each K row's load, 512 to 8192 keys per task time
    # the same within 5 %: 1 thread, 16k keys, D = 64).
    kb = max(MIN_KEYS_PER_TASK, min(-(-Kc // blocks), TASK_K_BYTES // (4 * D)))
    counting = stats is not None and stats.enabled
    # The kernel adds the step's statistics to the layer's packed counters itself (what stats.update would add from
    # its rowstats and vrows): a dozen tensor ops less per layer call, which at 16k keys is ~10 % of a decode step.
    srow, cols = (stats.decode_row(layer), stats.decode_columns) if counting else (_NO_STATS, [])
    out, _, _ = ext.decode((query.float() * scaling).reshape(B, H, D).contiguous(), key, window, valid, theta, raw,
                           cal, vbar, bool(lowered.vmc and sparse), lowered.sdc_mode, lowered.sdc_scale, post, kb,
                           srow, cols, sparsifier.k_for(layer) if sparse else 0)
    if counting:
        stats.count_clamped(rows.clamped_rows, query.device)
    return out.view(B, 1, H, -1).to(query.dtype)


_NO_STATS = torch.empty(0, dtype=torch.float64)


class _AllValid:
    """The (B, 1, 1, K) all-true valid mask of an unmasked decode row, built only if a reader asks for it."""

    def __init__(self, B: int, K: int, device):
        self.B, self.K, self.device = B, K, device

    def __call__(self) -> torch.Tensor:
        return torch.ones(1, 1, 1, self.K, dtype=torch.bool, device=self.device).expand(self.B, 1, 1, self.K)


def _logits(q: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """q (R, G, D) float32 times the keys (B, Hkv, Kc, D) of any dtype -> (R, G, Kc) float32."""
    B, Hkv, Kc, D = key.shape
    if key.dtype == torch.float32:
        return torch.bmm(q, key.reshape(B * Hkv, Kc, D).transpose(1, 2))
    s = q.new_empty(q.shape[0], q.shape[1], Kc)
    for a in range(0, Kc, BLOCK_KEYS):  # a low-precision cache: convert one block of keys at a time
        b = min(Kc, a + BLOCK_KEYS)
        torch.bmm(q, key[:, :, a:b].float().reshape(B * Hkv, b - a, D).transpose(1, 2), out=s[:, :, a:b])
    return s


def _weighted_sum(w: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """w (R, G, Kc) float32 times every V row (B, Hkv, Kc, Dv) -> (R, G, Dv) float32."""
    B, Hkv, Kc, Dv = value.shape
    if value.dtype == torch.float32:
        return torch.bmm(w, value.reshape(B * Hkv, Kc, Dv))
    o = w.new_zeros(w.shape[0], w.shape[1], Dv)
    for a in range(0, Kc, BLOCK_KEYS):
        b = min(Kc, a + BLOCK_KEYS)
        o.baddbmm_(w[:, :, a:b], value[:, :, a:b].float().reshape(B * Hkv, b - a, Dv))
    return o


def _kept_rows_sum(ek: torch.Tensor, keep: torch.Tensor, value: torch.Tensor, ks: int) -> torch.Tensor:
    """Σ_j ek_j · v_j over the kept V rows only: ek, keep (R, G, Kc); value (B, Hkv, K, Dv) -> (R, G, Dv)."""
    R, G, Kc = ek.shape
    Dv = value.shape[-1]
    union = keep.any(1)  # (R, Kc) kept V rows of each (sequence, KV head)
    counts = union.sum(-1)  # (R,)
    U = int(counts.max())
    if U > DENSE_ABOVE * Kc:  # most rows are needed anyway: one dense GEMM beats the gather
        return _weighted_sum(ek, value[:, :, ks:ks + Kc])
    r, j = union.nonzero().unbind(1)  # (N,) each: row-major, so each (sequence, KV head)'s keys in order
    slot = torch.arange(r.numel(), device=r.device) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    dest = r * U + slot  # where each kept row goes in its zero-padded block of U rows
    v_rows = value.flatten(0, 1)[r, j + ks]  # (N, Dv): reads only the kept rows (a view: no copy of a cache
    # whose heads sit apart in a larger buffer, as cache.GrowingLayer's do)
    v_kept = ek.new_zeros(R * U, Dv).index_copy_(0, dest, v_rows.float())
    heads = torch.arange(G, device=r.device) * Kc
    w_rows = ek.take((r * (G * Kc) + j)[:, None] + heads)  # (N, G) weights; heads that dropped the row give 0
    w_kept = ek.new_zeros(R * U, G).index_copy_(0, dest, w_rows)
    return torch.bmm(w_kept.view(R, U, G).transpose(1, 2), v_kept.view(R, U, Dv))  # padded slots weigh 0


def _running_mean(layer: int, value: torch.Tensor, valid_row: torch.Tensor | None, ke: int,
                  n: torch.Tensor) -> torch.Tensor:
    """Mean of the valid V rows in [0, ke) (B, Hkv, 1, Dv) float32, from the layer's running sum."""
    B, Hkv, _, Dv = value.shape
    slot = (layer, B, Hkv, Dv, value.dtype, value.device)
    state = _VSUMS.get(slot)
    if state is not None and not _still_valid(state, value, valid_row, ke):
        state = None
    if state is None:  # first step after a prefill, or the cache was cropped or edited: sum it all once
        lo, total = 0, value.new_zeros(B, Hkv, Dv, dtype=torch.float64)
    else:
        lo, total = state.upto, state.total  # the old state is replaced below: its sum can be added to in place
    if valid_row is None and lo == ke - 1:  # one new row, every key valid: the loop's sum, in two fewer ops
        total += value[:, :, lo]  # (float32 to float64 is exact; a sum over one row is that row)
        lo = ke
    for a in range(lo, ke, BLOCK_KEYS):  # normally one new row
        b = min(ke, a + BLOCK_KEYS)
        rows = value[:, :, a:b].double()  # (B, Hkv, b − a, Dv)
        if valid_row is not None:
            rows = rows * valid_row[:, None, a:b, None]
        total += rows.sum(2)
    count = valid_row[:, :ke].sum(-1) if valid_row is not None else None
    _VSUMS[slot] = _VSum(ke, total, count, value[:, :, ke - 1].clone())
    if valid_row is None:  # n is ke in every sequence: the same division by a Python number
        return (total / max(ke, 1)).float().unsqueeze(2)
    return (total / n.view(B, 1, 1).clamp_min(1)).float().unsqueeze(2)


def _still_valid(state: _VSum, value: torch.Tensor, valid_row: torch.Tensor | None, ke: int) -> bool:
    """Whether a running sum still describes this cache's prefix [0, state.upto)."""
    if not 0 < state.upto <= ke or state.total.device != value.device:
        return False
    if valid_row is None:
        count_ok = state.count is None or bool((state.count == state.upto).all())
    else:
        counts = valid_row[:, :state.upto].sum(-1)
        count_ok = bool((counts == state.upto).all()) if state.count is None else torch.equal(counts, state.count)
    return count_ok and torch.equal(value[:, :, state.upto - 1], state.last)


def reset() -> None:
    """Forget every running V sum (they are rebuilt from the cache on the next step)."""
    _VSUMS.clear()
