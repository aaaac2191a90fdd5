"""Top-θ prefill in Triton: flash-attention tiles, pre-softmax in one pass, post-softmax in two (method.md §2-3).

One program per (block of BLOCK_M query rows, sequence × head); the KV head is h // G, so K/V are never
expanded for GQA. For a row with running maximum m the program keeps, as the Triton fused-attention tutorial,

    l = Σ_valid e^{s−m}  (dense denominator),  R = Σ_kept e^{s−m},  acc = Σ_kept e^{s−m}·v,  |S| kept keys

and rescales them by e^{m_old − m_new} when m grows. The two placements:

* pre-softmax (one pass): keep s > θ on the logits. A key tile in which no row keeps a score skips its V
  load and its P·V product (counted in ``skipped_tiles``) when ``skip_tiles``; V rows no row of the block keeps
  are then masked out of the load. Off by default: on an H200 the per-tile column reduction and branch cost more
  than the loads they save (16k keys, bf16, 1/3 kept: 10.2 ms without against 14.1 ms with, FlashAttention 6.5 ms;
  results/bench/gpu_tune.md), and without them the V loads pipeline; every V tile is then read, weights 0
  where nothing is kept. At the end: denominator R + λ·E with E = l − R (exact SDC), (n − |S|)·e^{min(θ,m)−m}
  (exp-threshold), the calibrated mass where something was dropped, or 0; o = acc / denominator + β·v̄ with
  β = 1 − R / denominator (VMC).
* post-softmax (two passes): pass 1 computes m and l; pass 2 keeps p = e^{s−m}/l > θ and accumulates
  acc = Σ_kept p·v; o = acc + β·v̄ with β = 1 − Σ_kept p.

Empty rows (a valid key but nothing above θ; method.md §9, 10a): "keep-max" keeps the row's maximum (every key
tied with it). Pre-softmax learns that a row is empty only at the end of the pass, so blocks with such a row
run a second loop that adds the keys equal to m (the logits recomputed with the same instructions, so the
same bits); rare, and free for blocks without one. "reference" keeps nothing: pre-softmax without SDC then
attends uniformly to all K keys of the call (the reference code's dtype-min row), given as ``v_all``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (NO_WINDOW, SDC_MODES, TritonAttention, check_device, check_qkv, launching_on, next_pow2,
                     row_bounds, row_inputs, stats_arguments, value_means)

TINY = tl.constexpr(1.1754943508222875e-38)  # float32 tiny, the plain kernel's clamp (a constexpr: kernels may read no other globals)


@triton.jit
def row_keys(ks, ke, pos, row_ok, window, CAUSAL: tl.constexpr):
    """Each row's keys [lo_row, hi_row): the sequence's [ks, ke), causality, the window (common.row_bounds is the
    same arithmetic). A row with no key (padding rows of the block, rows before the sequence's first key) gets the
    empty range [ks, ks): its bounds stay inside the keys, so the tile loop (up to the largest hi_row) and the K and
    V loads it masks never reach past them."""
    lo_row = tl.zeros_like(pos) + ks
    hi_row = tl.zeros_like(pos) + ke
    if CAUSAL:
        hi_row = tl.minimum(hi_row, pos + 1)
        lo_row = tl.maximum(lo_row, pos - window + 1)
    live = row_ok & (hi_row > lo_row)
    return tl.where(live, lo_row, ks), tl.where(live, hi_row, ks)


@triton.jit
def skip_cut(m, offset):
    """Skip-softmax's cut of each row (float32): the float64 c = min(m + offset, m), offset = ln(λ/n) (−inf for rows
    kept whole), rounded up to the next float32, so that a float32 score s ≥ cut exactly when s ≥ c in float64 (the
    plain kernel's ``SkipSoftmax.cut``, the same operations); the maximum always passes (keep-max)."""
    exact = tl.minimum(m.to(tl.float64) + offset, m.to(tl.float64))
    cut = exact.to(tl.float32)
    bits = cut.to(tl.int32, bitcast=True)
    up = tl.where(cut > 0, bits + 1, tl.where(cut < 0, bits - 1, 1)).to(tl.float32, bitcast=True)  # next float up
    return tl.where(cut.to(tl.float64) < exact, up, cut)


@triton.jit
def empty_mask(live, theta, m, top, POST: tl.constexpr, SKIP: tl.constexpr):
    """Rows with a valid key where nothing passes θ (method.md §9): post-softmax when the largest probability
    ``top`` does not exceed θ (θ ≥ 0), pre-softmax when the row max ``m`` does not; skip-softmax (θ holds ln(λ/n))
    when λ > n."""
    if SKIP:
        empty = live & (theta > 0)
    elif POST:
        empty = live & (theta >= 0) & (top <= theta)
    else:
        empty = live & (m <= theta)
    return empty


@triton.jit
def kept_weights(s, valid, m, l, theta, cut, empty, top, POST: tl.constexpr, SKIP: tl.constexpr,
                 KEEP_MAX: tl.constexpr):
    """One tile's rule once the row's max ``m`` and dense sum ``l`` are known: (weights, keep), the weights
    e^{s−m} before the softmax or the probabilities e^{s−m}/l after it, 0 where not kept. Top-θ keeps s > θ (pre)
    or p > θ (post), and an ``empty`` row its maximum (keep-max: every key tied with it); skip-softmax keeps
    s ≥ ``cut`` (``skip_cut``), which the maximum always passes."""
    w = tl.exp(s - m[:, None])
    if POST:
        w = w / tl.maximum(l, TINY)[:, None]
    if SKIP:
        keep = valid & (s >= cut[:, None])
    elif POST:
        keep = valid & (w > theta[:, None])
        if KEEP_MAX:
            keep = keep | (valid & empty[:, None] & (w >= top[:, None]))
    else:
        keep = valid & (s > theta[:, None])
        if KEEP_MAX:
            keep = keep | (valid & empty[:, None] & (s >= m[:, None]))
    return tl.where(keep, w, 0.0), keep


@triton.jit
def compensated(acc, r_i, l_i, m, theta, n, cnt, empty, MASS_ptr, VALL_ptr, row, row_ok, kv, offs_dv, DV,
                sdc_scale, POST: tl.constexpr, SDC: tl.constexpr, UNIFORM: tl.constexpr):
    """(o, β, kept mass) of each row from the kept sums (acc = Σ_kept w·v, r_i = Σ_kept w, cnt kept keys; l_i the
    dense sum, m the row max). Post-softmax: o = acc, β = 1 − Σ_kept p. Pre-softmax: o = acc / (R + λ·E) with the
    dropped mass E exact (SDC 1), (n − |S|)·e^{min(θ,m)−m} (2, exp-threshold), the calibrated mean where something
    was dropped (3) or 0, β = 1 − R / denominator; ``UNIFORM`` rows (reference empty rows without SDC) attend
    uniformly to the call's keys (v_all of KV head ``kv``). VMC adds β·v̄ afterwards."""
    if POST:
        o = acc
        beta = 1.0 - r_i
        kept_mass = r_i
    else:
        if SDC == 1:  # exact: the dropped keys' own mass
            e_drop = tl.maximum(l_i - r_i, 0.0)
        elif SDC == 2:  # exp-threshold: every dropped logit is ≤ min(θ, m)
            n_drop = (n - cnt).to(tl.float32)
            e_drop = tl.where(n_drop > 0, n_drop * tl.exp(tl.minimum(theta, m) - m), 0.0)
        elif SDC == 3:  # calibrated mean dropped mass, where something was dropped
            mass = tl.load(MASS_ptr + row, mask=row_ok, other=0.0)
            e_drop = tl.where(cnt < n, mass, 0.0)
        else:
            e_drop = tl.zeros_like(r_i)
        denom = tl.maximum(r_i + sdc_scale * e_drop, TINY)
        o = acc / denom[:, None]
        beta = 1.0 - r_i / denom
        if UNIFORM:
            v_all = tl.load(VALL_ptr + kv * DV + offs_dv, mask=offs_dv < DV, other=0.0)
            o = tl.where(empty[:, None], v_all[None, :], o)
            beta = tl.where(empty, 0.0, beta)
        kept_mass = r_i / tl.maximum(l_i, TINY)
    return o, beta, kept_mass


@triton.jit
def tile_scores(q, K_ptr, offs_n, offs_d, lo_row, hi_row, stride_kn, stride_kd, D, scaling,
            SCALE_Q: tl.constexpr, IEEE: tl.constexpr):
    """(BLOCK_M, BLOCK_N) float32 scaled logits of one key tile, −inf outside each row's [lo_row, hi_row)."""
    valid = (offs_n[None, :] >= lo_row[:, None]) & (offs_n[None, :] < hi_row[:, None])
    in_cache = (offs_n[:, None] >= 0) & (offs_n[:, None] < tl.max(hi_row, 0))
    k = tl.load(K_ptr + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=in_cache & (offs_d[None, :] < D), other=0.0)  # (BLOCK_N, BLOCK_D)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if not SCALE_Q:  # 16-bit inputs: products exact in float32, scaled after the dot
        s = s * scaling
    return tl.where(valid, s, float("-inf")), valid


@triton.jit
def tile_pv(acc, w, V_ptr, offs_n, offs_dv, cols, stride_vn, stride_vd, DV, IEEE: tl.constexpr):
    """acc + w·V over one key tile, reading only the V rows some row of the block keeps (``cols``)."""
    v = tl.load(V_ptr + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=(cols[:, None] > 0) & (offs_dv[None, :] < DV), other=0.0)  # (BLOCK_N, BLOCK_DV)
    if IEEE:
        return acc + tl.dot(w, v, input_precision="ieee")
    return acc + tl.dot(w.to(v.dtype), v)


@triton.jit
def _prefill_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    KS_ptr, KE_ptr, QO_ptr, THETA_ptr, MASS_ptr, VMEAN_ptr, VALL_ptr,
    KEPT_ptr, KMASS_ptr, EMPTY_ptr, TILES_ptr, SKIP_ptr,
    STATS_ptr, C_KEPT, C_VALID, C_VKEPT, C_VVALID, C_STEPS, C_ROWS, C_DROPPED, C_EMPTY,
    H, G, Hkv, Qn, D, DV, window, scaling, sdc_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    POST: tl.constexpr, SDC: tl.constexpr, VMC: tl.constexpr, KEEP_MAX: tl.constexpr, UNIFORM: tl.constexpr,
    CAUSAL: tl.constexpr, SCALE_Q: tl.constexpr, IEEE: tl.constexpr, STATS: tl.constexpr, SPARSE: tl.constexpr,
    SKIP_TILES: tl.constexpr, SKIP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # 64-bit offsets: b · stride passes 2^31 in a batch of long sequences
    b = tl.program_id(2).to(tl.int64)
    hkv = h // G
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Qn

    ks = tl.load(KS_ptr + b)
    pos = tl.load(QO_ptr + b) + offs_m
    lo_row, hi_row = row_keys(ks, tl.load(KE_ptr + b), pos, row_ok, window, CAUSAL)
    n = hi_row - lo_row  # (BLOCK_M,) valid keys
    live = n > 0
    lo = tl.min(tl.where(live, lo_row, 1 << 30), 0)
    hi = tl.max(hi_row, 0)

    q_ptrs = Q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if SCALE_Q:  # float32 inputs: scaled before the dot, as the plain kernel
        q = q * scaling
    row = (b * H + h) * Qn + offs_m
    theta = tl.load(THETA_ptr + row, mask=row_ok, other=float("-inf"))
    Kb = K_ptr + b * skb + hkv * skh
    Vb = V_ptr + b * svb + hkv * svh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if POST or SKIP:  # pass 1: the row max and the dense denominator
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            s, valid = tile_scores(q, Kb, offs_n, offs_d, lo_row, hi_row, skn, skd, D, scaling, SCALE_Q, IEEE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_use) + tl.sum(tl.exp(s - m_use[:, None]), 1)
            m_i = m_new
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        top = 1.0 / tl.maximum(l_i, TINY)  # the largest probability, e^{m−m}/l
        empty = empty_mask(live, theta, m_fin, top, POST, SKIP)
        if SKIP:  # THETA holds ln(λ/n): a row whose cut passes its maximum keeps the maximum
            cut = skip_cut(m_fin, theta)
        else:
            cut = theta

    r_i = tl.zeros([BLOCK_M], tl.float32)
    cnt = tl.zeros([BLOCK_M], tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    tiles = 0
    skipped = 0
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s, valid = tile_scores(q, Kb, offs_n, offs_d, lo_row, hi_row, skn, skd, D, scaling, SCALE_Q, IEEE)
        if POST or SKIP:  # the row's max is known: weights e^{s−m} (pre), or the dense probabilities (post)
            w, keep = kept_weights(s, valid, m_fin, l_i, theta, cut, empty, top, POST, SKIP, KEEP_MAX)
        else:  # online softmax; the selection is a mask on the logits
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            w = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(w, 1)
            r_i = r_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
            keep = valid & (s > theta[:, None])
            w = tl.where(keep, w, 0.0)
        r_i += tl.sum(w, 1)
        cnt += tl.sum(keep.to(tl.int32), 1)
        tiles += 1
        if SKIP_TILES:
            cols = tl.max(keep.to(tl.int32), 0)  # (BLOCK_N,) V rows some row keeps
            if tl.max(cols, 0) > 0:
                acc = tile_pv(acc, w, Vb, offs_n, offs_dv, cols, svn, svd, DV, IEEE)
            else:  # nothing passed θ in this tile: no V load, no P·V
                skipped += 1
        else:  # every V row of the key range, no branch: no cross-warp reduction per tile, loads can pipeline
            acc = tile_pv(acc, w, Vb, offs_n, offs_dv, (offs_n < hi).to(tl.int32), svn, svd, DV, IEEE)

    if not POST and not SKIP:
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        empty = empty_mask(live, theta, m_fin, m_fin, POST, SKIP)
        if KEEP_MAX:
            if tl.max(empty.to(tl.int32), 0) > 0:  # rare: keep each empty row's maximum (the same logits again)
                for start in range(lo, hi, BLOCK_N):
                    offs_n = start + tl.arange(0, BLOCK_N)
                    s, valid = tile_scores(q, Kb, offs_n, offs_d, lo_row, hi_row, skn, skd, D, scaling, SCALE_Q, IEEE)
                    keep = valid & empty[:, None] & (s >= m_fin[:, None])
                    w = tl.where(keep, tl.exp(s - m_fin[:, None]), 0.0)
                    cols = tl.max(keep.to(tl.int32), 0)
                    if tl.max(cols, 0) > 0:
                        r_i += tl.sum(w, 1)
                        cnt += tl.sum(keep.to(tl.int32), 1)
                        acc = tile_pv(acc, w, Vb, offs_n, offs_dv, cols, svn, svd, DV, IEEE)

    # Epilogue: denominators, compensation, statistics.
    o, beta, kept_mass = compensated(acc, r_i, l_i, m_fin, theta, n, cnt, empty, MASS_ptr, VALL_ptr, row, row_ok,
                                     b * Hkv + hkv, offs_dv, DV, sdc_scale, POST, SDC, UNIFORM)
    if VMC:
        beta = tl.where(live, beta, 0.0)
        vm_ptrs = VMEAN_ptr + ((b * Hkv + hkv) * Qn + offs_m[:, None]) * DV + offs_dv[None, :]
        v_mean = tl.load(vm_ptrs, mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        o = o + beta[:, None] * v_mean

    o_ptrs = O_ptr + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :] * sod
    tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(KEPT_ptr + row, cnt, mask=row_ok)
    tl.store(KMASS_ptr + row, kept_mass, mask=row_ok)
    tl.store(EMPTY_ptr + row, empty.to(tl.int8), mask=row_ok)
    prog = (b * H + h) * tl.num_programs(0) + pid_m
    tl.store(TILES_ptr + prog, tiles)
    tl.store(SKIP_ptr + prog, skipped)
    if STATS:  # the call's statistics, added to the layer's packed counters (stats.SparsityStats.packed_row)
        counted = row_ok & live
        tl.atomic_add(STATS_ptr + C_KEPT + h, tl.sum(tl.where(row_ok, cnt, 0), 0).to(tl.float64))
        tl.atomic_add(STATS_ptr + C_VALID + h, tl.sum(tl.where(row_ok, n, 0), 0).to(tl.float64))
        tl.atomic_add(STATS_ptr + C_ROWS + h, tl.sum(counted.to(tl.int32), 0).to(tl.float64))
        if SPARSE:
            dropped = tl.where(counted, tl.maximum(1.0 - kept_mass, 0.0), 0.0)
            tl.atomic_add(STATS_ptr + C_DROPPED + h, tl.sum(dropped, 0).to(tl.float64))
            tl.atomic_add(STATS_ptr + C_EMPTY + h, tl.sum((row_ok & empty).to(tl.int32), 0).to(tl.float64))


def prefill_attention(
    query: torch.Tensor,  # (B, H, Q, D)
    key: torch.Tensor,  # (B, Hkv, K, D)
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
    sdc_mass: torch.Tensor | None = None,  # (B|1, H|1, Q) calibrated dropped mass E per row (sdc="calibrated")
    vmc: bool = False,
    v_mean: torch.Tensor | None = None,  # (B, Hkv, Q, Dv) float32 v̄ per row; computed here when None
    empty_rows: str = "keep-max",
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    stats_row: torch.Tensor | None = None,  # the layer's packed counters (SparsityStats.packed_row): added to here
    stats_columns=None,  # their first columns, as common.stats_target
    skip_tiles: bool = False,  # True: skip the V load and P·V of tiles where nothing is kept (a per-tile branch)
    cut_offset: torch.Tensor | None = None,  # (B|1, H|1, Q) float64 skip-softmax ln(λ/n) per row, instead of theta
) -> TritonAttention:
    """Top-θ (or dense, ``placement=None``) prefill attention; see the module docstring for what it computes.

    ``theta`` is already looked up for each row's valid length (``lowering.row_thresholds``): a row gets −inf
    when the sparsifier keeps it whole (n ≤ k, uncalibrated). Pre-softmax θ is a logit, post-softmax a
    probability (negative = keep whole). +inf is allowed (an empty row). No host reads: every check is on
    shapes, the grid too.

    Skip-softmax (``SkipSoftmax``: s ≥ m + ln(λ/n), m the row's maximum) gives ``cut_offset`` (float64 ln(λ/n),
    −inf for rows kept whole, ``SkipSoftmax.cut_offsets``) instead of ``theta``: both placements then run the two
    passes, the first finding each row's true maximum (not the running one of one-pass tiled kernels, which keep
    more; sparsifiers/skipsoftmax.py), so the kept sets are the plain kernel's.
    """
    B, H, Hkv, Q, K, D, Dv = check_qkv(query, key, value)
    device = check_device(_prefill_kernel, query, key, value)
    rows = row_inputs(value, B, H, Q, device, theta=theta, cut_offset=cut_offset, placement=placement,
                      key_start=key_start, key_end=key_end, q_offset=q_offset, causal=causal, window=window, sdc=sdc,
                      sdc_mass=sdc_mass, empty_rows=empty_rows)
    post, sparse = placement == "post", rows.sparse
    lo, hi = row_bounds(rows.key_start, rows.key_end, rows.q_offset, Q, window, causal)
    vmc = bool(vmc and sparse)
    if vmc:
        v_mean = value_means(value, lo, hi) if v_mean is None else v_mean.float().contiguous()
        if v_mean.shape != (B, Hkv, Q, Dv):
            raise ValueError(f"v_mean must be (B, Hkv, Q, Dv) = {(B, Hkv, Q, Dv)}, got {tuple(v_mean.shape)}")
    else:
        v_mean = rows.theta

    wide = 64 if query.dtype != torch.float32 else 32  # float32 tiles take twice the shared memory
    BLOCK_M = block_m or wide
    BLOCK_N = block_n or wide
    if BLOCK_M < 16 or BLOCK_N < 16 or BLOCK_M & (BLOCK_M - 1) or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block sizes must be powers of two ≥ 16 (tl.dot), got {BLOCK_M}, {BLOCK_N}")
    out = torch.empty(B, H, Q, Dv, dtype=query.dtype, device=device)
    kept = torch.empty(B, H, Q, dtype=torch.int32, device=device)
    kept_mass = torch.empty(B, H, Q, dtype=torch.float32, device=device)
    empty = torch.empty(B, H, Q, dtype=torch.int8, device=device)
    n_mblocks = triton.cdiv(Q, BLOCK_M)
    tiles = torch.zeros(B, H, n_mblocks, dtype=torch.int32, device=device)
    skipped = torch.zeros(B, H, n_mblocks, dtype=torch.int32, device=device)
    ieee = query.dtype == torch.float32
    grid = (n_mblocks, H, B)  # the order of (m-block, b · H + h) programs, each axis within CUDA's 65,535 limit
    stats_args, counting = stats_arguments(stats_row, stats_columns, kept_mass)
    extra = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    with launching_on(device):
        _prefill_kernel[grid](
            query, key, value, out,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(),
            rows.key_start, rows.key_end, rows.q_offset, rows.theta, rows.mass, v_mean, rows.v_all,
            kept, kept_mass, empty, tiles, skipped, *stats_args,
            H, H // Hkv, Hkv, Q, D, Dv, window or NO_WINDOW, float(scaling), float(sdc_scale),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)),
            POST=post, SDC=SDC_MODES[sdc], VMC=vmc, KEEP_MAX=empty_rows == "keep-max" or not sparse,
            UNIFORM=rows.uniform, CAUSAL=causal, SCALE_Q=ieee, IEEE=ieee, STATS=counting, SPARSE=sparse,
            SKIP_TILES=bool(skip_tiles), SKIP=rows.skip,
            **extra,
        )
    n = (hi - lo).to(torch.int32)  # (B, Q)
    return TritonAttention(out=out, n=n, kept=kept, kept_mass=kept_mass, empty=empty.bool(), vrows=None,
                           tiles=tiles, skipped_tiles=skipped)
