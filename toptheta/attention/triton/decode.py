"""Top-θ decode in Triton: a few query rows (Q = 1 in generation) over a KV cache (method.md §2.4, §5).

One program per (sequence, KV head) holds the G query heads of the group and the Q rows as GP·QP stacked rows
(G and Q padded to powers of two, at least 16 rows for tl.dot), so each K tile is loaded once for the whole
group, and a V row is loaded only when some head of the group keeps it: the kept V rows the paper counts.
Per key tile: logits, selection on logits (pre) or probabilities (post, after a first pass for m and l), the
union over the group's heads (counted per query row), then P·V on the kept rows; a tile nobody keeps loads no
V at all. Compensation and empty rows follow the prefill kernel (``prefill.py``) line for line: exact /
exp-threshold / calibrated SDC, VMC with v̄ given (a running V sum kept beside the cache, or means), and the
keep-max rule's second loop for pre-softmax rows where nothing passed θ (it counts only the V rows it adds to
the union).

Known limit: no split over keys (flash-decoding); a long cache with few (sequence, KV head) pairs leaves most
of a GPU idle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (NO_WINDOW, SDC_MODES, TritonAttention, check_device, check_options, check_qkv, next_pow2,
                     per_row, per_sequence, row_bounds, value_means)
from .prefill import TINY, _pv, _scores

MAX_ROWS = 256  # GP·QP rows per program


@triton.jit
def _union(keep, GP: tl.constexpr, QP: tl.constexpr, BLOCK_N: tl.constexpr):
    """(QP,) int32: keys of the tile that some head keeps, per query row (rows are r = g·QP + q)."""
    any_head = tl.max(tl.reshape(keep.to(tl.int32), (GP, QP, BLOCK_N)), 0)  # (QP, BLOCK_N)
    return tl.sum(any_head, 1)


@triton.jit
def _decode_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
    KS_ptr, KE_ptr, QO_ptr, THETA_ptr, MASS_ptr, VMEAN_ptr, VALL_ptr,
    KEPT_ptr, KMASS_ptr, EMPTY_ptr, VROWS_ptr, TILES_ptr, SKIP_ptr,
    H, G, Hkv, Qn, D, DV, window, scaling, sdc_scale,
    GP: tl.constexpr, QP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    POST: tl.constexpr, SDC: tl.constexpr, VMC: tl.constexpr, KEEP_MAX: tl.constexpr, UNIFORM: tl.constexpr,
    CAUSAL: tl.constexpr, SCALE_Q: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)  # sequence × KV head
    b = pid // Hkv
    hkv = pid % Hkv
    r = tl.arange(0, GP * QP)
    g = r // QP
    qi = r % QP
    row_ok = (g < G) & (qi < Qn)
    h = hkv * G + g
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    ks = tl.load(KS_ptr + b)
    ke = tl.load(KE_ptr + b)
    pos = tl.load(QO_ptr + b) + qi
    lo_row = tl.zeros([GP * QP], tl.int32) + ks
    hi_row = tl.zeros([GP * QP], tl.int32) + ke
    if CAUSAL:
        hi_row = tl.minimum(hi_row, pos + 1)
        lo_row = tl.maximum(lo_row, pos - window + 1)
    hi_row = tl.where(row_ok, tl.maximum(hi_row, lo_row), lo_row)
    n = hi_row - lo_row
    live = n > 0
    lo = tl.min(tl.where(live, lo_row, 1 << 30), 0)
    hi = tl.max(hi_row, 0)

    q_ptrs = Q_ptr + b * sqb + h[:, None] * sqh + qi[:, None] * sqm + offs_d[None, :] * sqd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if SCALE_Q:
        q = q * scaling
    row = (b * H + h) * Qn + qi
    theta = tl.load(THETA_ptr + row, mask=row_ok, other=float("-inf"))
    Kb = K_ptr + b * skb + hkv * skh
    Vb = V_ptr + b * svb + hkv * svh

    m_i = tl.full([GP * QP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP * QP], tl.float32)
    if POST:  # pass 1: m and l
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            s, valid = _scores(q, Kb, offs_n, offs_d, lo_row, hi_row, skn, skd, D, scaling, SCALE_Q, IEEE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_use) + tl.sum(tl.exp(s - m_use[:, None]), 1)
            m_i = m_new
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        top = 1.0 / tl.maximum(l_i, TINY)
        empty = live & (theta >= 0) & (top <= theta)

    r_i = tl.zeros([GP * QP], tl.float32)
    cnt = tl.zeros([GP * QP], tl.int32)
    vr = tl.zeros([QP], tl.int32)
    acc = tl.zeros([GP * QP, BLOCK_DV], tl.float32)
    tiles = 0
    skipped = 0
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        s, valid = _scores(q, Kb, offs_n, offs_d, lo_row, hi_row, skn, skd, D, scaling, SCALE_Q, IEEE)
        if POST:
            w = tl.exp(s - m_fin[:, None]) / tl.maximum(l_i, TINY)[:, None]
            keep = valid & (w > theta[:, None])
            if KEEP_MAX:
                keep = keep | (valid & empty[:, None] & (w >= top[:, None]))
        else:
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
        vr += _union(keep, GP, QP, BLOCK_N)
        cols = tl.max(keep.to(tl.int32), 0)
        tiles += 1
        if tl.max(cols, 0) > 0:
            acc = _pv(acc, w, Vb, offs_n, offs_dv, cols, svn, svd, DV, IEEE)
        else:
            skipped += 1

    if not POST:
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        empty = live & (m_fin <= theta)
        if KEEP_MAX:
            if tl.max(empty.to(tl.int32), 0) > 0:
                for start in range(lo, hi, BLOCK_N):
                    offs_n = start + tl.arange(0, BLOCK_N)
                    s, valid = _scores(q, Kb, offs_n, offs_d, lo_row, hi_row, skn, skd, D, scaling, SCALE_Q, IEEE)
                    keep = valid & empty[:, None] & (s >= m_fin[:, None])
                    cols = tl.max(keep.to(tl.int32), 0)
                    if tl.max(cols, 0) > 0:
                        main = valid & (s > theta[:, None])  # what the first loop kept: count only new V rows
                        vr += _union(main | keep, GP, QP, BLOCK_N) - _union(main, GP, QP, BLOCK_N)
                        w = tl.where(keep, tl.exp(s - m_fin[:, None]), 0.0)
                        r_i += tl.sum(w, 1)
                        cnt += tl.sum(keep.to(tl.int32), 1)
                        acc = _pv(acc, w, Vb, offs_n, offs_dv, cols, svn, svd, DV, IEEE)

    if POST:
        o = acc
        beta = 1.0 - r_i
        kept_mass = r_i
    else:
        if SDC == 1:
            e_drop = tl.maximum(l_i - r_i, 0.0)
        elif SDC == 2:
            n_drop = (n - cnt).to(tl.float32)
            e_drop = tl.where(n_drop > 0, n_drop * tl.exp(tl.minimum(theta, m_fin) - m_fin), 0.0)
        elif SDC == 3:
            mass = tl.load(MASS_ptr + row, mask=row_ok, other=0.0)
            e_drop = tl.where(cnt < n, mass, 0.0)
        else:
            e_drop = tl.zeros([GP * QP], tl.float32)
        denom = tl.maximum(r_i + sdc_scale * e_drop, TINY)
        o = acc / denom[:, None]
        beta = 1.0 - r_i / denom
        kept_mass = r_i / tl.maximum(l_i, TINY)
        if UNIFORM:
            v_all = tl.load(VALL_ptr + (b * Hkv + hkv) * DV + offs_dv, mask=offs_dv < DV, other=0.0)
            o = tl.where(empty[:, None], v_all[None, :], o)
            beta = tl.where(empty, 0.0, beta)
    if VMC:
        beta = tl.where(live, beta, 0.0)
        vm_ptrs = VMEAN_ptr + ((b * Hkv + hkv) * Qn + qi[:, None]) * DV + offs_dv[None, :]
        v_mean = tl.load(vm_ptrs, mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        o = o + beta[:, None] * v_mean

    o_ptrs = O_ptr + b * sob + h[:, None] * soh + qi[:, None] * som + offs_dv[None, :] * sod
    tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(KEPT_ptr + row, cnt, mask=row_ok)
    tl.store(KMASS_ptr + row, kept_mass, mask=row_ok)
    tl.store(EMPTY_ptr + row, empty.to(tl.int8), mask=row_ok)
    offs_q = tl.arange(0, QP)
    tl.store(VROWS_ptr + (b * Hkv + hkv) * Qn + offs_q, vr, mask=offs_q < Qn)
    tl.store(TILES_ptr + pid, tiles)
    tl.store(SKIP_ptr + pid, skipped)


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
) -> TritonAttention:
    """Top-θ (or dense, ``placement=None``) attention of a few query rows over a cache; the inputs mean what
    they mean for ``prefill.prefill_attention``. The result's ``vrows`` holds the kept V rows per (B, Hkv, Q)."""
    B, H, Hkv, Q, K, D, Dv = check_qkv(query, key, value)
    device = check_device(_decode_kernel, query, key, value)
    check_options(placement, sdc, empty_rows)
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal rows and window ≥ 1, got window={window}, causal={causal}")
    if sdc == "calibrated" and sdc_mass is None:
        raise ValueError("sdc='calibrated' needs sdc_mass, the calibrated dropped mass per row (B, H, Q)")
    G = H // Hkv
    GP, QP = next_pow2(G), next_pow2(Q)
    QP = max(QP, 16 // GP)  # at least 16 stacked rows for tl.dot
    if GP * QP > MAX_ROWS:
        raise ValueError(f"{G} heads per KV head × {Q} query rows is too many rows for one decode program "
                         f"(at most {MAX_ROWS}); use prefill_attention")
    post = placement == "post"
    ks = per_sequence(key_start, B, 0, device)
    ke = per_sequence(key_end, B, K, device)
    qo = per_sequence(q_offset, B, K - Q, device)
    th = per_row(theta, B, H, Q, device, "theta", fill=float("-inf"))
    mass = per_row(sdc_mass, B, H, Q, device, "sdc_mass") if sdc == "calibrated" else th
    lo, hi = row_bounds(ks, ke, qo, Q, window, causal)
    n = hi - lo  # (B, Q)
    sparse = placement is not None
    vmc = bool(vmc and sparse)
    if vmc:
        if v_mean is None and v_sum is not None:
            if Q != 1 or v_sum.shape != (B, Hkv, Dv):
                raise ValueError(f"v_sum is the (B, Hkv, Dv) = {(B, Hkv, Dv)} V sum of a single query row (Q = 1), "
                                 f"got {tuple(v_sum.shape)} with Q = {Q}; pass v_mean instead")
            v_mean = v_sum[:, :, None, :].double() / n.clamp_min(1)[:, None, :, None]
        v_mean = value_means(value, lo, hi) if v_mean is None else v_mean.float().contiguous()
        if v_mean.shape != (B, Hkv, Q, Dv):
            raise ValueError(f"v_mean must be (B, Hkv, Q, Dv) = {(B, Hkv, Q, Dv)}, got {tuple(v_mean.shape)}")
    else:
        v_mean = th
    uniform = sparse and not post and sdc is None and empty_rows == "reference"
    v_all = value.float().mean(2).contiguous() if uniform else th

    BLOCK_N = block_n or 64
    if BLOCK_N < 16 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block_n must be a power of two ≥ 16 (tl.dot), got {BLOCK_N}")
    out = torch.empty(B, H, Q, Dv, dtype=query.dtype, device=device)
    kept = torch.empty(B, H, Q, dtype=torch.int32, device=device)
    kept_mass = torch.empty(B, H, Q, dtype=torch.float32, device=device)
    empty = torch.empty(B, H, Q, dtype=torch.int8, device=device)
    vrows = torch.empty(B, Hkv, Q, dtype=torch.int32, device=device)
    tiles = torch.zeros(B, Hkv, dtype=torch.int32, device=device)
    skipped = torch.zeros(B, Hkv, dtype=torch.int32, device=device)
    ieee = query.dtype == torch.float32
    extra = {} if num_warps is None else {"num_warps": num_warps}
    _decode_kernel[(B * Hkv,)](
        query, key, value, out,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        ks, ke, qo, th, mass, v_mean, v_all,
        kept, kept_mass, empty, vrows, tiles, skipped,
        H, G, Hkv, Q, D, Dv, window or NO_WINDOW, float(scaling), float(sdc_scale),
        GP=GP, QP=QP, BLOCK_N=BLOCK_N, BLOCK_D=max(16, next_pow2(D)), BLOCK_DV=max(16, next_pow2(Dv)),
        POST=post, SDC=SDC_MODES[sdc], VMC=vmc, KEEP_MAX=empty_rows == "keep-max" or not sparse, UNIFORM=uniform,
        CAUSAL=causal, SCALE_Q=ieee, IEEE=ieee, **extra,
    )
    return TritonAttention(out=out, n=n.to(torch.int32), kept=kept, kept_mass=kept_mass, empty=empty.bool(),
                           vrows=vrows, tiles=tiles, skipped_tiles=skipped)
