"""The C++ one-pass prefill kernel behind ``prefill.py`` (flash-attention style, CPU, float32).

For each (sequence, KV head, block of queries) the G query heads are stacked as rows; key blocks stream
by: one GEMM gives the logits (our own micro-kernel, not BLAS: see ``gemm``), one loop per row updates the online softmax (running max m, dense sum
l = Σ e^{s−m}), keeps s > θ (the kept sum R = Σ_kept e^{s−m}, kept count, the weights), and a second GEMM
adds the kept weights times V to the row's accumulator. A row that ends with nothing above θ keeps its
maximum (tracked on the side while nothing was kept). At the end each row is normalised with the plain
kernel's formulas: renormalised over the kept set, SDC's λ·E added to the denominator, VMC's β·v̄ added.
Built on first use with torch's C++ extension tooling (cached in ``~/.cache/torch_extensions``); where that
fails, ``extension()`` returns None after one log line and the plain kernel runs.
"""

from __future__ import annotations

import functools
import logging

from .fused import PARALLEL_PROBE, VECTOR_EXPF, build

log = logging.getLogger("toptheta")
_VERSION = 8  # bump when _SOURCE or the flags change: the build cache is keyed by name

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
""" + VECTOR_EXPF + PARALLEL_PROBE + r"""
static constexpr float NEG = -1.0e30f;  // "no key": a finite sentinel (exp of it minus a row max gives 0)

// C (m × n, row stride ldc) = A (m × k, lda) · B (k × n, ldb), or += with ACC; row-major float32.
// A register-blocked micro-kernel (6 × 16 tiles: 12 AVX2 accumulators) instead of ATen's GEMM: called inside
// at::parallel_for, a BLAS call would nest its own threads in ours. On the kernel's shapes it runs at the speed of
// single-threaded MKL (measured side by side, 1 thread: 55-79 against 46-69 GFLOP/s). At long rows the second GEMM mostly becomes
// `accumulate`'s sparse path.
template <bool ACC>
static void gemm(int64_t m, int64_t n, int64_t k, const float* __restrict A, int64_t lda,
                 const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc) {
  constexpr int MR = 6, NR = 16;
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    const int64_t nj = std::min<int64_t>(NR, n - j0);
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
      const int64_t mi = std::min<int64_t>(MR, m - i0);
      if (mi == MR && nj == NR) {  // full tile: fixed trip counts, kept in registers
        float c[MR][NR];
        for (int ii = 0; ii < MR; ++ii)
#pragma omp simd
          for (int jj = 0; jj < NR; ++jj) c[ii][jj] = ACC ? C[(i0 + ii) * ldc + j0 + jj] : 0.0f;
        for (int64_t p = 0; p < k; ++p) {
          const float* b = B + p * ldb + j0;
          for (int ii = 0; ii < MR; ++ii) {
            const float a = A[(i0 + ii) * lda + p];
#pragma omp simd
            for (int jj = 0; jj < NR; ++jj) c[ii][jj] += a * b[jj];
          }
        }
        for (int ii = 0; ii < MR; ++ii)
#pragma omp simd
          for (int jj = 0; jj < NR; ++jj) C[(i0 + ii) * ldc + j0 + jj] = c[ii][jj];
      } else {  // edge tile
        for (int64_t ii = 0; ii < mi; ++ii) {
          float c[NR];
          for (int64_t jj = 0; jj < nj; ++jj) c[jj] = ACC ? C[(i0 + ii) * ldc + j0 + jj] : 0.0f;
          for (int64_t p = 0; p < k; ++p) {
            const float a = A[(i0 + ii) * lda + p];
            const float* b = B + p * ldb + j0;
            for (int64_t jj = 0; jj < nj; ++jj) c[jj] += a * b[jj];
          }
          for (int64_t jj = 0; jj < nj; ++jj) C[(i0 + ii) * ldc + j0 + jj] = c[jj];
        }
      }
    }
  }
}

// A (rows × Dv) += W (rows × kc) · V (kc × Dv), W holding `kept` nonzero weights at most. Top-θ keeps about k of a
// row's n keys, so at long rows almost every weight is 0: then only the kept V rows are read and added (one pass
// over W to find them); above a quarter of the weights, one GEMM.
static void accumulate(int64_t rows, int64_t kc, int64_t Dv, const float* __restrict W, const float* __restrict V,
                       float* __restrict A, int64_t kept) {
  if (4 * kept > rows * kc) {
    gemm<true>(rows, Dv, kc, W, kc, V, Dv, A, Dv);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* w = W + r * kc;
    float* a = A + r * Dv;
    for (int64_t j = 0; j < kc; ++j) {
      if (w[j] == 0.0f) continue;
      const float wj = w[j];
      const float* vr = V + j * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) a[d] += wj * vr[d];
    }
  }
}

// q (B, H, Q, D) scaled, k (B, Hkv, K, D), v (B, Hkv, K, Dv): float32 contiguous.
// mask: (B, Q, K) bool of any strides, or empty: causal, query i sits at key K - Q + i.
// theta (B, H, Q): keep s > theta (finite; -1e29 keeps every valid key), or empty: dense (keep all, no VMC).
// raw (B, H, Q): theta as calibrated (exp-threshold SDC: each dropped key adds ≤ exp(min(θ, m) − m)); cal (B, H, Q): calibrated dropped mass (SDC 3).
// vmc: 0 none, 1 v̄ given in vbar (B, Hkv, Q, Dv), 2 causal: v̄ = prefix means computed here (float64 sums).
// sdc: 0 none, 1 exact, 2 exp-threshold, 3 calibrated; lam = λ. post: theta is a probability threshold (two passes:
// the row's max and dense sum first, then keep p > θ and the row's maximum; weights stay dense probabilities).
// Returns out (B, Q, H, Dv) and rowstats (B, H, Q, 3): kept count, kept dense mass R / l, empty (sparse only).
std::vector<torch::Tensor> prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                                   torch::Tensor theta, torch::Tensor raw, torch::Tensor cal, torch::Tensor vbar,
                                   int64_t vmc_mode, int64_t sdc, double lam, int64_t qb, int64_t kb, bool post) {
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), K = k.size(2), Dv = v.size(3), G = H / Hkv;
  const bool causal = mask.numel() == 0, sparse = theta.numel() > 0, vmc = vmc_mode > 0;
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "q, k, v must be float32");
  auto out = torch::zeros({B, Q, H, Dv}, q.options());
  auto rowstats = torch::zeros({B, H, Q, 3}, q.options());
  const float* Qp = q.data_ptr<float>();
  const float* Vp = v.data_ptr<float>();
  const bool* Mp = causal ? nullptr : mask.data_ptr<bool>();
  const int64_t ms0 = causal ? 0 : mask.stride(0), ms1 = causal ? 0 : mask.stride(1), ms2 = causal ? 0 : mask.stride(2);
  const float* Tp = sparse ? theta.data_ptr<float>() : nullptr;
  const float* RTp = sdc == 2 ? raw.data_ptr<float>() : nullptr;
  const float* Cp = sdc == 3 ? cal.data_ptr<float>() : nullptr;
  if (vmc_mode == 2) {  // causal v̄: the mean of V rows 0..K-Q+i, from running float64 sums
    TORCH_CHECK(causal, "vmc_mode 2 needs a causal call");
    vbar = torch::empty({B, Hkv, Q, Dv}, q.options());
    float* VB = vbar.data_ptr<float>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t r0, int64_t r1) {
      std::vector<double> sum(Dv);
      for (int64_t r = r0; r < r1; ++r) {
        std::fill(sum.begin(), sum.end(), 0.0);
        const float* vr = Vp + r * K * Dv;
        for (int64_t j = 0; j < K; ++j) {
          for (int64_t d = 0; d < Dv; ++d) sum[d] += vr[j * Dv + d];
          const int64_t i = j - (K - Q);
          if (i >= 0) {
            float* o = VB + (r * Q + i) * Dv;
            for (int64_t d = 0; d < Dv; ++d) o[d] = (float)(sum[d] / (double)(j + 1));
          }
        }
      }
    });
  }
  const float* VBp = vmc ? vbar.data_ptr<float>() : nullptr;
  const auto kt = k.transpose(2, 3).contiguous();  // (B, Hkv, D, K): the logits GEMM reads key blocks as rows
  const float* KTp = kt.data_ptr<float>();
  float* Op = out.data_ptr<float>();
  float* RSp = rowstats.data_ptr<float>();
  const float tiny = std::numeric_limits<float>::min();
  const int64_t nqb = (Q + qb - 1) / qb, tasks = B * Hkv * nqb;

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    const int64_t rows_max = G * qb, kmax = std::min(kb, K);
    // Per-thread scratch, reused across calls: fresh buffers of a few hundred kB would be new pages every call.
    thread_local std::vector<float> qbuf, acc, sbuf, accmax;
    qbuf.resize(std::max<size_t>(qbuf.size(), rows_max * D));
    acc.resize(std::max<size_t>(acc.size(), rows_max * Dv));
    accmax.resize(std::max<size_t>(accmax.size(), rows_max * Dv));
    sbuf.resize(std::max<size_t>(sbuf.size(), rows_max * kmax));
    std::vector<float> m(rows_max), l(rows_max), R(rows_max);
    std::vector<int64_t> cnt(rows_max), cmax(rows_max), n(rows_max), passed(rows_max), nv(rows_max);
    for (int64_t tt = t0; tt < t1; ++tt) {
      // Zig-zag order: causal blocks grow with the query index; pairing short and long ones balances threads.
      const int64_t half = tt / 2, t = (tt % 2 == 0) ? half : tasks - 1 - half;
      const int64_t bh = t / nqb, blk = t % nqb;
      const int64_t b = bh / Hkv, kvh = bh % Hkv, q0 = blk * qb, qc = std::min(qb, Q - q0), rows = G * qc;
      float* QB = qbuf.data();
      for (int64_t g = 0; g < G; ++g)
        std::memcpy(QB + g * qc * D, Qp + (((b * H) + kvh * G + g) * Q + q0) * D, sizeof(float) * qc * D);
      // Key range of the block: causal up to the last query's position; a mask: its first..last valid key.
      int64_t k_lo = 0, k_hi = K - Q + q0 + qc;
      if (!causal) {
        k_lo = K; k_hi = 0;
        for (int64_t i = q0; i < q0 + qc; ++i) {
          const bool* mr = Mp + b * ms0 + i * ms1;
          int64_t j = 0;
          while (j < K && !mr[j * ms2]) ++j;
          if (j == K) continue;
          k_lo = std::min(k_lo, j);
          int64_t e = K - 1;
          while (!mr[e * ms2]) --e;
          k_hi = std::max(k_hi, e + 1);
        }
        if (k_hi <= k_lo) { k_lo = 0; k_hi = 0; }
      }
      std::fill(m.begin(), m.end(), NEG);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(R.begin(), R.end(), 0.0f);
      std::fill(cnt.begin(), cnt.end(), 0);
      std::fill(cmax.begin(), cmax.end(), 0);
      std::fill(n.begin(), n.end(), 0);
      std::fill(passed.begin(), passed.end(), 0);
      float* A = acc.data();
      float* AM = accmax.data();
      std::memset(A, 0, sizeof(float) * rows * Dv);
      std::memset(AM, 0, sizeof(float) * rows * Dv);
      // Logits of key block [k0, k0 + kc) for every row, invalid keys set to NEG; returns the valid keys per row in nv.
      float* S = sbuf.data();
      auto logits = [&](int64_t k0, int64_t kc) {
        gemm<false>(rows, kc, D, QB, D, KTp + (b * Hkv + kvh) * D * K + k0, K, S, kc);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = q0 + r % qc;
          float* s = S + r * kc;
          if (causal) {
            const int64_t lim = std::max<int64_t>(0, std::min<int64_t>(kc, K - Q + i - k0 + 1));
            for (int64_t j = lim; j < kc; ++j) s[j] = NEG;
            nv[r] = lim;
          } else {
            const bool* mr = Mp + b * ms0 + i * ms1 + k0 * ms2;
            int64_t c = 0;
            for (int64_t j = 0; j < kc; ++j) { if (mr[j * ms2]) ++c; else s[j] = NEG; }
            nv[r] = c;
          }
        }
      };
      if (sparse && post) {
        // Pass 1: each row's maximum m and dense sum l = Σ e^{s−m} (online, no selection).
        for (int64_t k0 = k_lo; k0 < k_hi; k0 += kb) {
          const int64_t kc = std::min(kb, k_hi - k0);
          logits(k0, kc);
          for (int64_t r = 0; r < rows; ++r) {
            if (nv[r] == 0) continue;
            n[r] += nv[r];
            const float* s = S + r * kc;
            float bm = NEG;
            for (int64_t j = 0; j < kc; ++j) bm = std::max(bm, s[j]);
            const float mo = m[r], mn = std::max(mo, bm);
            if (mn > mo) { l[r] *= mo > 0.5f * NEG ? expf(mo - mn) : 0.0f; m[r] = mn; }
            float ls = 0.0f;
#pragma omp simd reduction(+:ls)
            for (int64_t j = 0; j < kc; ++j) ls += expf(s[j] - mn);
            l[r] += ls;
          }
        }
        // Pass 2: p = e^{s−m}/l; keep p > θ and the row's maximum (e = 1), as the plain kernel; weights e^{s−m}.
        for (int64_t k0 = k_lo; k0 < k_hi; k0 += kb) {
          const int64_t kc = std::min(kb, k_hi - k0);
          logits(k0, kc);
          int64_t block_kept = 0;
          for (int64_t r = 0; r < rows; ++r) {
            float* s = S + r * kc;
            if (nv[r] == 0) { std::memset(s, 0, sizeof(float) * kc); continue; }
            const int64_t g = r / qc, i = q0 + r % qc, h = kvh * G + g;
            const float th = Tp[(b * H + h) * Q + i], inv = 1.0f / std::max(l[r], tiny), mr = m[r];
            float rs = 0.0f;
            int64_t c = 0, pc = 0;
#pragma omp simd reduction(+:rs, c, pc)
            for (int64_t j = 0; j < kc; ++j) {
              const float e = expf(s[j] - mr);
              const bool valid = s[j] > 0.5f * NEG, pass = valid && e * inv > th, keep = pass || (valid && e >= 1.0f);
              const float w = keep ? e : 0.0f;
              rs += w; c += keep ? 1 : 0; pc += pass ? 1 : 0;
              s[j] = w;
            }
            R[r] += rs; cnt[r] += c; passed[r] += pc; block_kept += c;
          }
          accumulate(rows, kc, Dv, S, Vp + ((b * Hkv + kvh) * K + k0) * Dv, A, block_kept);
        }
      }
      else for (int64_t k0 = k_lo; k0 < k_hi; k0 += kb) {  // one pass: online softmax with the selection
        const int64_t kc = std::min(kb, k_hi - k0);
        logits(k0, kc);
        int64_t block_kept = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t g = r / qc, i = q0 + r % qc, h = kvh * G + g;
          float* s = S + r * kc;
          n[r] += nv[r];
          float bm = NEG;
          for (int64_t j = 0; j < kc; ++j) bm = std::max(bm, s[j]);
          if (!(bm > 0.5f * NEG)) {  // no valid key of this row in the block
            std::memset(s, 0, sizeof(float) * kc);
            continue;
          }
          const float mo = m[r], mn = std::max(mo, bm);
          if (mn > mo) {
            const float sc = mo > 0.5f * NEG ? expf(mo - mn) : 0.0f;
            l[r] *= sc; R[r] *= sc;
            float* ar = A + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) ar[d] *= sc;
            m[r] = mn;
            if (cnt[r] == 0) { cmax[r] = 0; std::memset(AM + r * Dv, 0, sizeof(float) * Dv); }
          }
          const float th = sparse ? Tp[(b * H + h) * Q + i] : 0.5f * NEG;
          const bool track = sparse && cnt[r] == 0;  // nothing above θ yet: the row's maximum may be all it keeps
          if (track) {
            for (int64_t j = 0; j < kc; ++j) {
              if (s[j] == mn) {
                const float* vr = Vp + ((b * Hkv + kvh) * K + k0 + j) * Dv;
                float* amr = AM + r * Dv;
                for (int64_t d = 0; d < Dv; ++d) amr[d] += vr[d];
                ++cmax[r];
              }
            }
          }
          float ls = 0.0f, rs = 0.0f;
          int64_t c = 0;
#pragma omp simd reduction(+:ls, rs, c)
          for (int64_t j = 0; j < kc; ++j) {
            const float e = expf(s[j] - mn);
            const bool keep = s[j] > th;
            const float w = keep ? e : 0.0f;
            ls += e; rs += w; c += keep ? 1 : 0;
            s[j] = w;
          }
          l[r] += ls; R[r] += rs; cnt[r] += c; block_kept += c;
        }
        accumulate(rows, kc, Dv, S, Vp + ((b * Hkv + kvh) * K + k0) * Dv, A, block_kept);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / qc, i = q0 + r % qc, h = kvh * G + g;
        const int64_t row = (b * H + h) * Q + i;
        float* o = Op + ((b * Q + i) * H + h) * Dv;
        const float* ar = A + r * Dv;
        if (!sparse) {
          const float inv = 1.0f / std::max(l[r], tiny);
          for (int64_t d = 0; d < Dv; ++d) o[d] = ar[d] * inv;
          continue;
        }
        if (post) {  // dense probabilities of the kept keys: no renormalisation, β = the dropped probability mass
          const float inv = 1.0f / std::max(l[r], tiny), kept = R[r] * inv;
          const float beta = (vmc && n[r] > 0) ? 1.0f - kept : 0.0f;
          const float* vb = vmc ? VBp + (((b * Hkv + kvh) * Q) + i) * Dv : nullptr;
          for (int64_t d = 0; d < Dv; ++d) o[d] = ar[d] * inv + (vmc ? beta * vb[d] : 0.0f);
          RSp[3 * row] = (float)cnt[r];
          RSp[3 * row + 1] = kept;
          RSp[3 * row + 2] = (passed[r] == 0 && n[r] > 0) ? 1.0f : 0.0f;  // only the maximum was kept
          continue;
        }
        float kept = R[r];
        int64_t c = cnt[r];
        if (c == 0 && n[r] > 0) {  // nothing above θ: the row keeps its maximum (exp(0) = 1 each)
          ar = AM + r * Dv; kept = (float)cmax[r]; c = cmax[r];
        }
        float mass = 0.0f;
        if (sdc == 1) mass = std::max(l[r] - kept, 0.0f);
        else if (sdc == 2 && n[r] > c) mass = (float)(n[r] - c) * expf(std::min(RTp[row], m[r]) - m[r]);
        else if (sdc == 3 && c < n[r]) mass = Cp[row];
        const float denom = std::max(kept + (float)lam * mass, tiny);
        const float beta = (vmc && n[r] > 0) ? 1.0f - kept / denom : 0.0f;
        const float* vb = vmc ? VBp + (((b * Hkv + kvh) * Q) + i) * Dv : nullptr;
        for (int64_t d = 0; d < Dv; ++d) o[d] = ar[d] / denom + (vmc ? beta * vb[d] : 0.0f);
        RSp[3 * row] = (float)c;
        RSp[3 * row + 1] = kept / std::max(l[r], tiny);
        RSp[3 * row + 2] = (cnt[r] == 0 && n[r] > 0) ? 1.0f : 0.0f;  // an empty row: nothing passed θ
      }
    }
  });
  return {out, rowstats};
}
"""


@functools.cache
def extension():
    """The compiled module, or None where it cannot be built (no compiler, TOPTHETA_FUSED=0)."""
    return build(f"toptheta_prefill_v{_VERSION}", _SOURCE, ["prefill"], "the one-pass prefill kernel",
                 "the plain kernel")
