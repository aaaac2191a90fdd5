"""Top-θ decode in Triton: a few query rows (Q = 1 in generation) over a KV cache (method.md §2.4, §5).

A decode step is memory-bound: the whole of K is read, and V only where a head keeps a key. One program per
(sequence, KV head) would leave most of a GPU idle (8 programs for LLaMA-3-8B at batch 1), so the keys are split
into chunks as in flash-decoding, one program per (sequence, KV head, chunk), in three launches:

1. ``_decode_logits``: the logits of the chunk's keys for the G heads of the group and the Q rows (GP·QP stacked
   rows, G and Q padded to powers of two, at least 16 for tl.dot), written to a float32 scratch (G·Q·K floats
   per KV head: 1/16 of K's bytes for 4 heads, D = 128, bf16), with the chunk's running max and dense sum.
2. ``_decode_select``: the chunks' (m, l) combined into the row's, so the selection is decided once with the
   row's own max: pre-softmax keeps s > θ, post-softmax e^{s−m}/l > θ, and an empty row (nothing above θ) keeps
   its maximum under "keep-max" in the same pass. Top-k and top-p rank each whole row: their boundary (a logit θ,
   and the last of the keys tied with it that still fit) is found in torch between launches 1 and 2, from the
   logits launch 1 wrote (``boundary``, e.g. ``lowering.topk_boundary``). The chunk's logits are read back from the
   scratch (not K); V is loaded only at rows some head of the group keeps, and a tile nobody keeps loads no V at all.
   Per chunk: Σ_kept w·v, Σ_kept w, kept keys, and the union of kept V rows over the group's heads.
3. ``_decode_finish``: the chunks' sums added (fixed order: deterministic), then compensation and VMC as the
   prefill kernel (``prefill.py``): exact / exp-threshold / calibrated SDC; VMC with v̄ given (a running V sum
   kept beside the cache, or means), or computed here.

The weights share one reference max per row (the row's), so no rescaling between chunks is needed and the sums
are those of a single pass. Memory per step beyond K and the kept V rows: the logits written and read once and
(chunks × rows × Dv) float32 partial sums, in buffers held from one call to the next (``release_buffers`` frees them).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

from .common import (NO_WINDOW, SDC_MODES, TritonAttention, check_device, check_qkv, launching_on, next_pow2,
                     row_bounds, row_inputs, stats_arguments, value_means)
from .prefill import TINY, compensated, empty_mask, kept_weights, row_keys, skip_cut, tile_pv, tile_scores

MAX_ROWS = 256  # GP·QP rows per program
PROGRAMS_PER_SM = 4  # chunks are sized so that (sequence, KV head, chunk) programs fill each SM this many times


@triton.jit
def _union(keep, GP: tl.constexpr, QP: tl.constexpr, BLOCK_N: tl.constexpr):
    """(QP,) int32: keys of the tile that some head keeps, per query row (rows are r = g·QP + q)."""
    any_head = tl.max(tl.reshape(keep.to(tl.int32), (GP, QP, BLOCK_N)), 0)  # (QP, BLOCK_N)
    return tl.sum(any_head, 1)


@triton.jit
def _group_rows(pid, KS_ptr, KE_ptr, QO_ptr, G, Hkv, Qn, window,
                GP: tl.constexpr, QP: tl.constexpr, CAUSAL: tl.constexpr):
    """The program's stacked rows r = g·QP + q: (b, hkv, g, qi, row_ok, lo_row, hi_row), keys [lo_row, hi_row)."""
    b = (pid // Hkv).to(tl.int64)  # 64-bit offsets: b · stride passes 2^31 in a batch of long caches
    hkv = (pid % Hkv).to(tl.int64)
    r = tl.arange(0, GP * QP)
    g = r // QP
    qi = r % QP
    row_ok = (g < G) & (qi < Qn)
    pos = tl.load(QO_ptr + b) + qi
    lo_row, hi_row = row_keys(tl.load(KS_ptr + b), tl.load(KE_ptr + b), pos, row_ok, window, CAUSAL)
    return b, hkv, g, qi, row_ok, lo_row, hi_row


@triton.jit
def _chunk_rows(lo_row, hi_row, split, CHUNK):
    """The chunk's part of each row's keys [lo_row, hi_row), and the chunk's overall key range [lo, hi)."""
    c_lo = split * CHUNK
    lo_row = tl.maximum(lo_row, c_lo)
    hi_row = tl.maximum(tl.minimum(hi_row, c_lo + CHUNK), lo_row)
    lo = tl.min(tl.where(hi_row > lo_row, lo_row, 1 << 30), 0)
    hi = tl.max(hi_row, 0)
    return lo_row, hi_row, lo, hi


@triton.jit
def _row_max_and_sum(M_ptr, L_ptr, pid, NS, R: tl.constexpr, NSP: tl.constexpr):
    """(m, l) of each stacked row from the chunks' partial (max, Σ e^{s−max}); m is 0 for rows without keys."""
    r = tl.arange(0, R)
    offs_s = tl.arange(0, NSP)
    idx = (pid * NS + offs_s[None, :]) * R + r[:, None]  # (R, NSP)
    m_part = tl.load(M_ptr + idx, mask=offs_s[None, :] < NS, other=float("-inf"))
    l_part = tl.load(L_ptr + idx, mask=offs_s[None, :] < NS, other=0.0)
    m = tl.max(m_part, 1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.where(l_part > 0, l_part * tl.exp(m_part - m_use[:, None]), 0.0), 1)
    return m_use, l


@triton.jit
def _decode_logits(
    Q_ptr, K_ptr, S_ptr, M_ptr, L_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    KS_ptr, KE_ptr, QO_ptr,
    G, Hkv, Qn, D, KP, NS, CHUNK, window, scaling,
    GP: tl.constexpr, QP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, SCALE_Q: tl.constexpr, IEEE: tl.constexpr, RANKED: tl.constexpr,
):
    pid = tl.program_id(0)  # sequence × KV head
    split = tl.program_id(1)  # key chunk
    b, hkv, g, qi, row_ok, lo_row, hi_row = _group_rows(pid, KS_ptr, KE_ptr, QO_ptr, G, Hkv, Qn, window, GP, QP,
                                                        CAUSAL)
    lo_row, hi_row, lo, hi = _chunk_rows(lo_row, hi_row, split, CHUNK)
    if RANKED:  # a logit at every key of the chunk, −inf outside the row: the boundary ranks whole scratch rows
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, KP)
    offs_d = tl.arange(0, BLOCK_D)
    h = hkv * G + g
    q = tl.load(Q_ptr + b * sqb + h[:, None] * sqh + qi[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if SCALE_Q:
        q = q * scaling
    Kb = K_ptr + b * skb + hkv * skh
    s_rows = S_ptr + (pid.to(tl.int64) * (G * Qn) + g * Qn + qi) * KP  # (R,) scratch rows, only row_ok's stored
    m_i = tl.full([GP * QP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP * QP], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s, valid = tile_scores(q, Kb, offs_n, offs_d, lo_row, hi_row, skn, skd, D, scaling, SCALE_Q, IEEE)
        if RANKED:
            tl.store(s_rows[:, None] + offs_n[None, :], s, mask=row_ok[:, None] & (offs_n[None, :] < hi))
        else:
            tl.store(s_rows[:, None] + offs_n[None, :], s, mask=valid)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_use) + tl.sum(tl.exp(s - m_use[:, None]), 1)
        m_i = m_new
    r = tl.arange(0, GP * QP)
    tl.store(M_ptr + (pid * NS + split) * (GP * QP) + r, m_i)
    tl.store(L_ptr + (pid * NS + split) * (GP * QP) + r, l_i)


@triton.jit
def _ranked_weights(s, valid, offs_n, m, l, theta, last, POST: tl.constexpr):
    """A boundary rule on one tile (Top-k, top-p: θ and ``last`` from ``boundary``): keep s > θ, and the keys tied
    with θ at index ≤ ``last``; the weights as ``prefill.kept_weights`` (e^{s−m}, over l after the softmax)."""
    w = tl.exp(s - m[:, None])
    if POST:
        w = w / tl.maximum(l, TINY)[:, None]
    tied = (s == theta[:, None]) & (offs_n[None, :] <= last[:, None])
    keep = valid & ((s > theta[:, None]) | tied)
    return tl.where(keep, w, 0.0), keep


@triton.jit
def _decode_select(
    V_ptr, S_ptr, M_ptr, L_ptr, ACC_ptr, R_ptr, CNT_ptr, VR_ptr, TILES_ptr, SKIP_ptr,
    svb, svh, svn, svd,
    KS_ptr, KE_ptr, QO_ptr, THETA_ptr, LAST_ptr,
    H, G, Hkv, Qn, DV, KP, NS, CHUNK, window,
    GP: tl.constexpr, QP: tl.constexpr, NSP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr,
    POST: tl.constexpr, KEEP_MAX: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, SKIP: tl.constexpr,
    RANKED: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b, hkv, g, qi, row_ok, lo_row, hi_row = _group_rows(pid, KS_ptr, KE_ptr, QO_ptr, G, Hkv, Qn, window, GP, QP,
                                                        CAUSAL)
    live = hi_row > lo_row
    m_fin, l_i = _row_max_and_sum(M_ptr, L_ptr, pid, NS, GP * QP, NSP)
    h = hkv * G + g
    theta = tl.load(THETA_ptr + (b * H + h) * Qn + qi, mask=row_ok, other=float("-inf"))
    top = 1.0 / tl.maximum(l_i, TINY)  # the largest probability
    if RANKED:  # θ is a logit of the row (Top-k's k-th, top-p's boundary): the row's maximum always passes
        last = tl.load(LAST_ptr + (b * H + h) * Qn + qi, mask=row_ok, other=-1)
        empty = live & False
    else:
        empty = empty_mask(live, theta, m_fin, top, POST, SKIP)
    if SKIP:
        cut = skip_cut(m_fin, theta)
    else:
        cut = theta
    lo_row, hi_row, lo, hi = _chunk_rows(lo_row, hi_row, split, CHUNK)
    offs_dv = tl.arange(0, BLOCK_DV)
    Vb = V_ptr + b * svb + hkv * svh
    s_rows = S_ptr + (pid.to(tl.int64) * (G * Qn) + g * Qn + qi) * KP

    r_i = tl.zeros([GP * QP], tl.float32)
    cnt = tl.zeros([GP * QP], tl.int32)
    vr = tl.zeros([QP], tl.int32)
    acc = tl.zeros([GP * QP, BLOCK_DV], tl.float32)
    tiles = 0
    skipped = 0
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = (offs_n[None, :] >= lo_row[:, None]) & (offs_n[None, :] < hi_row[:, None])
        s = tl.load(s_rows[:, None] + offs_n[None, :], mask=valid, other=float("-inf"))
        if RANKED:
            w, keep = _ranked_weights(s, valid, offs_n, m_fin, l_i, theta, last, POST)
        else:
            w, keep = kept_weights(s, valid, m_fin, l_i, theta, cut, empty, top, POST, SKIP, KEEP_MAX)
        r_i += tl.sum(w, 1)
        cnt += tl.sum(keep.to(tl.int32), 1)
        vr += _union(keep, GP, QP, BLOCK_N)
        cols = tl.max(keep.to(tl.int32), 0)
        tiles += 1
        if tl.max(cols, 0) > 0:
            acc = tile_pv(acc, w, Vb, offs_n, offs_dv, cols, svn, svd, DV, IEEE)
        else:  # nobody keeps a key of this tile: no V load, no P·V
            skipped += 1

    part = pid * NS + split
    r = tl.arange(0, GP * QP)
    tl.store(ACC_ptr + (part * (GP * QP) + r[:, None]) * BLOCK_DV + offs_dv[None, :], acc)
    tl.store(R_ptr + part * (GP * QP) + r, r_i)
    tl.store(CNT_ptr + part * (GP * QP) + r, cnt)
    tl.store(VR_ptr + part * QP + tl.arange(0, QP), vr)
    tl.store(TILES_ptr + part, tiles)
    tl.store(SKIP_ptr + part, skipped)


@triton.jit
def _decode_finish(
    O_ptr, M_ptr, L_ptr, ACC_ptr, R_ptr, CNT_ptr, VR_ptr, TILES_ptr, SKIP_ptr,
    sob, soh, som, sod,
    KS_ptr, KE_ptr, QO_ptr, THETA_ptr, MASS_ptr, VMEAN_ptr, VALL_ptr,
    KEPT_ptr, KMASS_ptr, EMPTY_ptr, N_ptr, VROWS_ptr, TILES_OUT_ptr, SKIP_OUT_ptr,
    STATS_ptr, C_KEPT, C_VALID, C_VKEPT, C_VVALID, C_STEPS, C_ROWS, C_DROPPED, C_EMPTY,
    H, G, Hkv, Qn, DV, NS, window, sdc_scale,
    GP: tl.constexpr, QP: tl.constexpr, NSP: tl.constexpr, BLOCK_DV: tl.constexpr,
    POST: tl.constexpr, SDC: tl.constexpr, VMC: tl.constexpr, VSUM: tl.constexpr, UNIFORM: tl.constexpr,
    CAUSAL: tl.constexpr, STATS: tl.constexpr, SPARSE: tl.constexpr, SKIP: tl.constexpr, RANKED: tl.constexpr,
):
    pid = tl.program_id(0)
    b, hkv, g, qi, row_ok, lo_row, hi_row = _group_rows(pid, KS_ptr, KE_ptr, QO_ptr, G, Hkv, Qn, window, GP, QP,
                                                        CAUSAL)
    n = hi_row - lo_row
    live = n > 0
    m_fin, l_i = _row_max_and_sum(M_ptr, L_ptr, pid, NS, GP * QP, NSP)
    h = hkv * G + g
    row = (b * H + h) * Qn + qi
    theta = tl.load(THETA_ptr + row, mask=row_ok, other=float("-inf"))
    if RANKED:  # a ranked row always keeps its maximum: never empty
        empty = live & False
    else:
        empty = empty_mask(live, theta, m_fin, 1.0 / tl.maximum(l_i, TINY), POST, SKIP)
    r = tl.arange(0, GP * QP)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_q = tl.arange(0, QP)
    acc = tl.zeros([GP * QP, BLOCK_DV], tl.float32)
    r_i = tl.zeros([GP * QP], tl.float32)
    cnt = tl.zeros([GP * QP], tl.int32)
    vr = tl.zeros([QP], tl.int32)
    tiles = 0
    skipped = 0
    for split in range(0, NS):  # in order: the same sums on every run
        part = pid * NS + split
        acc += tl.load(ACC_ptr + (part * (GP * QP) + r[:, None]) * BLOCK_DV + offs_dv[None, :])
        r_i += tl.load(R_ptr + part * (GP * QP) + r)
        cnt += tl.load(CNT_ptr + part * (GP * QP) + r)
        vr += tl.load(VR_ptr + part * QP + offs_q)
        tiles += tl.load(TILES_ptr + part)
        skipped += tl.load(SKIP_ptr + part)

    o, beta, kept_mass = compensated(acc, r_i, l_i, m_fin, theta, n, cnt, empty, MASS_ptr, VALL_ptr, row, row_ok,
                                     b * Hkv + hkv, offs_dv, DV, sdc_scale, POST, SDC, UNIFORM)
    if VMC:
        beta = tl.where(live, beta, 0.0)
        if VSUM:  # v̄ = Σ V / n from a running float64 sum (B, Hkv, Dv); one query row
            v_sum = tl.load(VMEAN_ptr + (b * Hkv + hkv) * DV + offs_dv, mask=offs_dv < DV, other=0.0)
            v_mean = (v_sum[None, :] / tl.maximum(n, 1).to(tl.float64)[:, None]).to(tl.float32)
        else:
            vm_ptrs = VMEAN_ptr + ((b * Hkv + hkv) * Qn + qi[:, None]) * DV + offs_dv[None, :]
            v_mean = tl.load(vm_ptrs, mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        o = o + beta[:, None] * v_mean

    tl.store(N_ptr + b * Qn + qi, n, mask=row_ok & (g == 0))
    o_ptrs = O_ptr + b * sob + h[:, None] * soh + qi[:, None] * som + offs_dv[None, :] * sod
    tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(KEPT_ptr + row, cnt, mask=row_ok)
    tl.store(KMASS_ptr + row, kept_mass, mask=row_ok)
    tl.store(EMPTY_ptr + row, empty.to(tl.int8), mask=row_ok)
    tl.store(VROWS_ptr + pid * Qn + offs_q, vr, mask=offs_q < Qn)
    tl.store(TILES_OUT_ptr + pid, tiles)
    tl.store(SKIP_OUT_ptr + pid, skipped)
    if STATS:  # the call's statistics, added to the layer's packed counters (stats.SparsityStats.packed_row)
        gg = tl.arange(0, GP)
        heads = hkv * G + gg
        head_ok = gg < G
        counted = row_ok & live
        first = row_ok & (g == 0)  # one head's rows: the sequence's valid keys and live rows, the same for every head
        n_seq = tl.sum(tl.where(first, n, 0), 0).to(tl.float64)
        live_seq = tl.sum((first & live).to(tl.int32), 0).to(tl.float64)
        per_head = tl.sum(tl.reshape(tl.where(row_ok, cnt, 0), (GP, QP)), 1)
        tl.atomic_add(STATS_ptr + C_KEPT + heads, per_head.to(tl.float64), mask=head_ok)
        tl.atomic_add(STATS_ptr + C_VALID + heads, tl.zeros([GP], tl.float64) + n_seq, mask=head_ok)
        tl.atomic_add(STATS_ptr + C_ROWS + heads, tl.zeros([GP], tl.float64) + live_seq, mask=head_ok)
        tl.atomic_add(STATS_ptr + C_VKEPT + hkv, tl.sum(tl.where(offs_q < Qn, vr, 0), 0).to(tl.float64))
        tl.atomic_add(STATS_ptr + C_VVALID + hkv, n_seq)
        tl.atomic_add(STATS_ptr + C_STEPS, 1.0, mask=pid == 0)  # one decode step per call
        if SPARSE:
            dropped = tl.where(counted, tl.maximum(1.0 - kept_mass, 0.0), 0.0)
            per_head_dropped = tl.sum(tl.reshape(dropped, (GP, QP)), 1)
            tl.atomic_add(STATS_ptr + C_DROPPED + heads, per_head_dropped.to(tl.float64), mask=head_ok)
            per_head_empty = tl.sum(tl.reshape((row_ok & empty).to(tl.int32), (GP, QP)), 1)
            tl.atomic_add(STATS_ptr + C_EMPTY + heads, per_head_empty.to(tl.float64), mask=head_ok)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device; 2 elsewhere (the interpreter: small shapes still get several chunks)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


GROWTH = 1.25  # a held buffer grows to 1.25× what a call needs: decoding (one key more a step) rarely regrows it
_HELD: dict[tuple, dict[str, torch.Tensor]] = {}  # (device, stream) -> the decode calls' internal buffers


def _buffers(device: torch.device, sizes: dict[str, tuple[int, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Flat buffers of at least ``sizes`` ({name: (elements, dtype)}) on ``device``, held from one call to the next:
    the kernels index them by their own arguments, never by a tensor's shape, and the calls on one stream run in
    order, so a call's buffers are free for the next call's launches. A decode step then allocates only what it
    returns: 9 fewer host-side tensor ops per layer call. ``release_buffers()`` frees them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    held = _HELD.setdefault((device, stream), {})
    for name, (numel, dtype) in sizes.items():
        buf = held.get(name)
        if buf is None or buf.numel() < numel:
            held[name] = torch.empty(max(1, int(numel * GROWTH)), dtype=dtype, device=device)
    return held


def release_buffers() -> None:
    """Free the buffers decode calls hold (e.g. after generating at a long context, before other work)."""
    _HELD.clear()


def chunking(B: int, Hkv: int, K: int, block_n: int, device: torch.device, splits: int | None = None):
    """(chunks, keys per chunk) of a decode call: enough (sequence, KV head, chunk) programs to fill the device
    PROGRAMS_PER_SM times, a chunk a whole number of key tiles. Shapes only: no host read."""
    want = splits or -(-PROGRAMS_PER_SM * _multiprocessors(device) // (B * Hkv))
    ns = max(1, min(want, -(-K // block_n)))
    chunk = max(block_n, -(-(-(-K // ns)) // block_n) * block_n)
    return max(1, -(-K // chunk)), chunk


def check_boundary(theta, cut_offset, placement: str | None, sdc: str | None, empty_rows: str) -> None:
    """The other arguments of a call with a ``boundary`` rule, or a ValueError naming the fix."""
    if theta is not None or cut_offset is not None:
        raise ValueError("give one rule: theta (Top-θ), cut_offset (skip-softmax) or boundary (Top-k, top-p)")
    if placement is None:
        raise ValueError("a boundary selects keys: it needs placement='pre' or 'post'")
    if sdc not in (None, "exact"):
        raise ValueError(f"SDC({sdc!r}) needs calibrated thresholds, which a boundary rule has not; use SDC('exact')")
    if empty_rows != "keep-max":
        raise ValueError("a boundary rule keeps each row's maximum, so no row is empty: empty_rows='keep-max'")


def row_logits(scratch: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The logits ``_decode_logits`` wrote to ``scratch`` with ``RANKED`` (every key, −inf outside each row's keys)
    as a (B, H, Q, K) view. ``shape`` = (B, Hkv, G, Q, K)."""
    B, Hkv, G, Q, K = shape
    return scratch[: B * Hkv * G * Q * K].view(B, Hkv * G, Q, K)  # rows r = g·Q + q of KV head hkv: head hkv·G + g


def decode_attention(
    query: torch.Tensor,  # (B, H, Q, D), Q small (1 in generation)
    key: torch.Tensor,  # (B, Hkv, K, D) the cache
    value: torch.Tensor,  # (B, Hkv, K, Dv)
    *,
    scaling: float,
    theta: torch.Tensor | None,  # (B|1, H|1, Q) float32 per-row θ; −inf keeps a row whole
    placement: str | None = "pre",
    key_start: torch.Tensor | int | None = None,  # (B,) first valid key (left padding); default 0
    key_end: torch.Tensor | int | None = None,  # (B,) one past the last valid key; default K
    q_offset: torch.Tensor | int | None = None,  # (B,) absolute position of query row 0; default K − Q
    causal: bool = True,
    window: int | None = None,
    sdc: str | None = None,
    sdc_scale: float = 1.0,
    sdc_mass: torch.Tensor | None = None,  # (B|1, H|1, Q) calibrated dropped mass per row (sdc="calibrated")
    vmc: bool = False,
    v_sum: torch.Tensor | None = None,  # (B, Hkv, Dv) Σ V over the row's valid keys (Q == 1): a running sum
    v_mean: torch.Tensor | None = None,  # (B, Hkv, Q, Dv) float32 v̄ per row; computed here when both are None
    empty_rows: str = "keep-max",
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int | None = None,  # key chunks per (sequence, KV head); default: enough programs to fill the device
    stats_row: torch.Tensor | None = None,  # the layer's packed counters (SparsityStats.packed_row): added to here
    stats_columns=None,  # their first columns, as common.stats_target
    cut_offset: torch.Tensor | None = None,  # (B|1, H|1, Q) float64 skip-softmax ln(λ/n) per row, instead of theta
    boundary: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,  # a rule over whole rows
) -> TritonAttention:
    """Top-θ, skip-softmax (``cut_offset``), a rule that ranks whole rows (``boundary``: Top-k, top-p) or dense
    (``placement=None``) attention of a few query rows over a cache; the inputs mean what they mean for
    ``prefill.prefill_attention``. The result's ``vrows`` holds the kept V rows per (B, Hkv, Q); ``tiles`` /
    ``skipped_tiles`` sum over the chunks.

    ``boundary`` maps the logits of every row (B, H, Q, K) float32, −inf at keys outside the row, to (θ, last), each
    (B, H, Q): the row keeps s > θ and the keys with s = θ at index ≤ last, and no row is empty
    (``lowering.topk_boundary``, ``lowering.topp_boundary``). It runs between the first two launches on the logits the
    first one wrote, in torch on the device: it must not read the host."""
    B, H, Hkv, Q, K, D, Dv = check_qkv(query, key, value)
    device = check_device(_decode_select, query, key, value)
    if boundary is not None:
        check_boundary(theta, cut_offset, placement, sdc, empty_rows)
    rows = row_inputs(value, B, H, Q, device, theta=theta, cut_offset=cut_offset, placement=placement,
                      key_start=key_start, key_end=key_end, q_offset=q_offset, causal=causal, window=window, sdc=sdc,
                      sdc_mass=sdc_mass, empty_rows=empty_rows)
    G = H // Hkv
    GP, QP = next_pow2(G), next_pow2(Q)
    QP = max(QP, 16 // GP)  # at least 16 stacked rows for tl.dot
    if GP * QP > MAX_ROWS:
        raise ValueError(f"{G} heads per KV head × {Q} query rows is too many rows for one decode program "
                         f"(at most {MAX_ROWS}); use prefill_attention")
    post, sparse = placement == "post", rows.sparse
    ks, ke, qo, th = rows.key_start, rows.key_end, rows.q_offset, rows.theta
    vmc = bool(vmc and sparse)
    vsum = vmc and v_mean is None and v_sum is not None  # v̄ = v_sum / n in the kernel (a running sum, Q = 1)
    if vsum:
        if Q != 1 or v_sum.shape != (B, Hkv, Dv):
            raise ValueError(f"v_sum is the (B, Hkv, Dv) = {(B, Hkv, Dv)} V sum of a single query row (Q = 1), "
                             f"got {tuple(v_sum.shape)} with Q = {Q}; pass v_mean instead")
        v_mean = v_sum.double().contiguous()
    elif vmc:
        v_mean = value_means(value, *row_bounds(ks, ke, qo, Q, window, causal)) if v_mean is None else \
            v_mean.float().contiguous()
        if v_mean.shape != (B, Hkv, Q, Dv):
            raise ValueError(f"v_mean must be (B, Hkv, Q, Dv) = {(B, Hkv, Q, Dv)}, got {tuple(v_mean.shape)}")
    else:
        v_mean = th

    # 16-bit: 128-key tiles in 2 warps, the fastest of the tuned settings on an H200 (results/bench/gpu_tune.md)
    BLOCK_N = block_n or (64 if query.dtype == torch.float32 else 128)
    if num_warps is None and query.dtype != torch.float32:
        num_warps = 2
    if BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block_n must be a power of two ≥ 16 (tl.dot), got {BLOCK_N}")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be ≥ 1, got {splits}")
    NS, CHUNK = chunking(B, Hkv, K, BLOCK_N, device, splits)
    R, BLOCK_DV = GP * QP, max(16, next_pow2(Dv))
    f32, i32, parts = torch.float32, torch.int32, B * Hkv * NS
    held = _buffers(device, {
        "scratch": (B * Hkv * G * Q * K, f32),  # the logits (B·Hkv, G·Q, K), written by pass 1 and read by pass 2
        "m": (parts * R, f32), "l": (parts * R, f32), "acc": (parts * R * BLOCK_DV, f32), "r": (parts * R, f32),
        "cnt": (parts * R, i32), "vr": (parts * QP, i32), "tiles": (parts, i32), "skip": (parts, i32),
    })  # each chunk's partial results (B·Hkv, NS, ...), read by the last pass
    scratch, m_part, l_part, acc_part, r_part = (held[k] for k in ("scratch", "m", "l", "acc", "r"))
    cnt_part, vr_part, tiles_part, skip_part = (held[k] for k in ("cnt", "vr", "tiles", "skip"))
    out = torch.empty(B, H, Q, Dv, dtype=query.dtype, device=device)
    kept = torch.empty(B, H, Q, dtype=torch.int32, device=device)
    kept_mass = torch.empty(B, H, Q, dtype=torch.float32, device=device)
    empty = torch.empty(B, H, Q, dtype=torch.int8, device=device)
    n = torch.empty(B, Q, dtype=torch.int32, device=device)
    vrows = torch.empty(B, Hkv, Q, dtype=torch.int32, device=device)
    tiles = torch.empty(B, Hkv, dtype=torch.int32, device=device)
    skipped = torch.empty(B, Hkv, dtype=torch.int32, device=device)
    ieee = query.dtype == torch.float32
    extra = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    win = window or NO_WINDOW
    group = dict(GP=GP, QP=QP, CAUSAL=causal)
    stats_args, counting = stats_arguments(stats_row, stats_columns, kept_mass)
    ranked = boundary is not None and sparse
    with launching_on(device):
        _decode_logits[(B * Hkv, NS)](
            query, key, scratch, m_part, l_part, *query.stride(), *key.stride(), ks, ke, qo,
            G, Hkv, Q, D, K, NS, CHUNK, win, float(scaling),
            BLOCK_N=BLOCK_N, BLOCK_D=max(16, next_pow2(D)), SCALE_Q=ieee, IEEE=ieee, RANKED=ranked, **group, **extra,
        )
        last = th  # a valid pointer the select kernel does not read
        if ranked:
            theta_rows, last_rows = boundary(row_logits(scratch, (B, Hkv, G, Q, K)))
            th = theta_rows.to(torch.float32).expand(B, H, Q).contiguous()
            last = last_rows.to(torch.int32).expand(B, H, Q).contiguous()
        _decode_select[(B * Hkv, NS)](
            value, scratch, m_part, l_part, acc_part, r_part, cnt_part, vr_part, tiles_part, skip_part,
            *value.stride(), ks, ke, qo, th, last, H, G, Hkv, Q, Dv, K, NS, CHUNK, win,
            NSP=next_pow2(NS), BLOCK_N=BLOCK_N, BLOCK_DV=BLOCK_DV, POST=post,
            KEEP_MAX=empty_rows == "keep-max" or not sparse, IEEE=ieee, SKIP=rows.skip, RANKED=ranked, **group, **extra,
        )
        _decode_finish[(B * Hkv,)](
            out, m_part, l_part, acc_part, r_part, cnt_part, vr_part, tiles_part, skip_part, *out.stride(),
            ks, ke, qo, th, rows.mass, v_mean, rows.v_all, kept, kept_mass, empty, n, vrows, tiles, skipped,
            *stats_args, H, G, Hkv, Q, Dv, NS, win, float(sdc_scale),
            NSP=next_pow2(NS), BLOCK_DV=BLOCK_DV, POST=post, SDC=SDC_MODES[sdc], VMC=vmc, VSUM=vsum,
            UNIFORM=rows.uniform, STATS=counting, SPARSE=sparse, SKIP=rows.skip, RANKED=ranked, **group, **extra,
        )
    return TritonAttention(out=out, n=n, kept=kept, kept_mass=kept_mass, empty=empty.view(torch.bool),
                           vrows=vrows, tiles=tiles, skipped_tiles=skipped)
