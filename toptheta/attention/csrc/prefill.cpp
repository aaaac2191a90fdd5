#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "common.h"
static constexpr float NEG = -1.0e30f;  // "no key": a finite sentinel (exp of it minus a row max gives 0)
static constexpr int64_t ROW_PAD = 16;
static constexpr int64_t POST_KEEP_BYTES = 1 << 23;  // a tile's logits kept between the two post-softmax passes  // rows are padded to a multiple of the GEMM tile width

// C (m × n, row stride ldc) = A (m × k) · B (k × n, ldb), or += with ACC; row-major float32. A is read as
// A[i, p] = A[i * lda + p], or with TA as A[p * lda + i] (A stored transposed). Each C element is one dot product
// summed in order of p, whatever the tile it falls in. A register-blocked micro-kernel (6 × 16 tiles: 12 AVX2
// accumulators) instead of ATen's GEMM: called inside at::parallel_for, a BLAS call would nest its own threads in
// ours. On the kernel's shapes it runs at the speed of single-threaded MKL (measured side by side, 1 thread: 55-79
// against 46-69 GFLOP/s).
template <bool ACC, bool TA>
static void gemm(int64_t m, int64_t n, int64_t k, const float* __restrict A, int64_t lda,
                 const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc) {
  constexpr int MR = 6, NR = 16;
  auto a_at = [&](int64_t i, int64_t p) { return TA ? A[p * lda + i] : A[i * lda + p]; };
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
            const float a = a_at(i0 + ii, p);
#pragma omp simd
            for (int jj = 0; jj < NR; ++jj) c[ii][jj] += a * b[jj];
          }
        }
        for (int ii = 0; ii < MR; ++ii)
#pragma omp simd
          for (int jj = 0; jj < NR; ++jj) C[(i0 + ii) * ldc + j0 + jj] = c[ii][jj];
      } else {  // edge tile: the same dot products, one row at a time
        for (int64_t ii = 0; ii < mi; ++ii) {
          float c[NR];
          for (int64_t jj = 0; jj < nj; ++jj) c[jj] = ACC ? C[(i0 + ii) * ldc + j0 + jj] : 0.0f;
          for (int64_t p = 0; p < k; ++p) {
            const float a = a_at(i0 + ii, p);
            const float* b = B + p * ldb + j0;
#pragma omp simd
            for (int64_t jj = 0; jj < nj; ++jj) c[jj] += a * b[jj];
          }
          for (int64_t jj = 0; jj < nj; ++jj) C[(i0 + ii) * ldc + j0 + jj] = c[jj];
        }
      }
    }
  }
}

// A (rows × Dv) += Wᵀ · V with W (kc × rp) holding each key's weights for the rows (`kept` nonzero at most) and
// V (kc × Dv). Top-θ keeps about k of a row's n keys, so at long rows almost every weight is 0: then only the
// kept V rows are read and added; above a quarter of the weights, one GEMM. Both add a row's weighted V rows in
// key order, so they give the same bits.
static void accumulate(int64_t rows, int64_t rp, int64_t kc, int64_t Dv, const float* __restrict W,
                       const float* __restrict V, float* __restrict A, int64_t kept) {
  if (4 * kept > rows * kc) {
    gemm<true, true>(rows, Dv, kc, W, rp, V, Dv, A, Dv);
    return;
  }
  for (int64_t j = 0; j < kc; ++j) {
    const float* w = W + j * rp;
    const float* vr = V + j * Dv;
    for (int64_t r = 0; r < rows; ++r) {
      if (w[r] == 0.0f) continue;
      const float wj = w[r];
      float* a = A + r * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) a[d] += wj * vr[d];
    }
  }
}

// A float64 mean rounded to float32, divided exactly: the build's -freciprocal-math would multiply by 1/n instead,
// and then a causal row's v̄ could differ by one bit from the same row's v̄ computed by the caller (masked calls).
__attribute__((noinline, optimize("no-reciprocal-math"))) static float mean_of(double sum, double n) {
  return (float)(sum / n);
}

// q (B, H, Q, D) scaled: float32 contiguous. k (B, Hkv, K, D), v (B, Hkv, K, Dv): float32, each (sequence, head)
// slab of K rows contiguous, any batch and head strides (a growing KV cache's views are read in place).
// mask: (B, Q, K) bool of any strides, or empty: causal, query i sits at key K - Q + i.
// theta (B, H, Q): keep s > theta (finite; -1e29 keeps every valid key), or empty: dense (keep all, no VMC).
// raw (B, H, Q): theta as calibrated (exp-threshold SDC: each dropped key adds ≤ exp(min(θ, m) − m)); cal (B, H, Q): calibrated dropped mass (SDC 3).
// vmc: 0 none, 1 v̄ given in vbar (B, Hkv, Q, Dv), 2 causal: v̄ = prefix means computed here (float64 sums, divided
// exactly as the caller's masked means are: see mean_of).
// sdc: 0 none, 1 exact, 2 exp-threshold, 3 calibrated; lam = λ. post: theta is a probability threshold (two passes:
// the row's max and dense sum first, then keep p > θ and the row's maximum; weights stay dense probabilities).
// offset (B, H, Q) float64, or empty: skip-softmax instead of θ (theta then empty): offset = ln(λ/n) per row, −inf
// for rows kept whole; two passes at either placement, the second keeping s ≥ cut, cut = min(m + offset, m) in
// float64 rounded up to the next float32 (as SkipSoftmax.cut), so the maximum always passes. post as above; pre
// renormalises over the kept keys (SDC exact only: the other estimators need a calibrated θ).
// Returns out (B, Q, H, Dv) and rowstats (B, H, Q, 3): kept count, kept dense mass R / l, empty (sparse only).
//
// A row's result does not depend on the batch it is in, its padding, its query block or the other rows: the
// logits are laid out keys × rows and every per-row quantity (max, sums, counts, weights) is computed in vector
// steps across rows, in key order within a row; key blocks lie on a grid that starts at the sequence's first
// valid key. Masked keys add exact zeros. So a sequence scored alone, left-padded in a batch, or as continuation
// rows against its cached context gives the same bits (and the same Top-θ decisions).
std::vector<torch::Tensor> prefill(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask,
                                   torch::Tensor theta, torch::Tensor offset, torch::Tensor raw, torch::Tensor cal,
                                   torch::Tensor vbar, int64_t vmc_mode, int64_t sdc, double lam, int64_t qb, int64_t kb,
                                   bool post) {
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), K = k.size(2), Dv = v.size(3), G = H / Hkv;
  const bool causal = mask.numel() == 0, skip = offset.numel() > 0, sparse = theta.numel() > 0 || skip,
             vmc = vmc_mode > 0, two_pass = sparse && (post || skip);
  TORCH_CHECK(!skip || (theta.numel() == 0 && offset.scalar_type() == torch::kFloat64 && offset.is_contiguous() &&
                        offset.numel() == B * H * Q && (sdc == 0 || sdc == 1)),
              "skip-softmax: offset (B, H, Q) float64 contiguous, no theta, SDC none or exact");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu() && theta.device().is_cpu() && offset.device().is_cpu() && raw.device().is_cpu() && cal.device().is_cpu() && vbar.device().is_cpu(), "toptheta: a CPU kernel was handed tensors on another device; the backend registry must not choose it there");
  TORCH_CHECK(q.is_contiguous() && k.stride(3) == 1 && v.stride(3) == 1 && (K == 1 || (k.stride(2) == D && v.stride(2) == Dv)),
              "q must be contiguous, and k and v contiguous within each (sequence, head)");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "q, k, v must be float32");
  TORCH_CHECK(kb > 0 && kb % ROW_PAD == 0, "the key block must be a positive multiple of 16");
  auto out = torch::zeros({B, Q, H, Dv}, q.options());
  auto rowstats = torch::zeros({B, H, Q, 3}, q.options());
  const float* Qp = q.data_ptr<float>();
  const float* Kp = k.data_ptr<float>();
  const float* Vp = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const bool* Mp = causal ? nullptr : mask.data_ptr<bool>();
  const int64_t ms0 = causal ? 0 : mask.stride(0), ms1 = causal ? 0 : mask.stride(1), ms2 = causal ? 0 : mask.stride(2);
  const float* Tp = sparse && !skip ? theta.data_ptr<float>() : nullptr;
  const double* OFp = skip ? offset.data_ptr<double>() : nullptr;
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
        const float* vr = Vp + (r / Hkv) * vs0 + (r % Hkv) * vs1;
        for (int64_t j = 0; j < K; ++j) {
          for (int64_t d = 0; d < Dv; ++d) sum[d] += vr[j * Dv + d];
          const int64_t i = j - (K - Q);
          if (i >= 0) {
            float* o = VB + (r * Q + i) * Dv;
            for (int64_t d = 0; d < Dv; ++d) o[d] = mean_of(sum[d], (double)(j + 1));
          }
        }
      }
    });
  }
  // The key-block grid of each sequence starts at its first valid key (0 when causal; the padding when left-padded).
  std::vector<int64_t> anchor(B, 0);
  if (!causal) {
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        int64_t first = K;
        for (int64_t i = 0; i < Q; ++i) {
          const bool* mr = Mp + b * ms0 + i * ms1;
          for (int64_t j = 0; j < first; ++j)
            if (mr[j * ms2]) { first = j; break; }
        }
        anchor[b] = first == K ? 0 : first;
      }
    });
  }
  const float* VBp = vmc ? vbar.data_ptr<float>() : nullptr;
  float* Op = out.data_ptr<float>();
  float* RSp = rowstats.data_ptr<float>();
  const float tiny = std::numeric_limits<float>::min();
  const int64_t nqb = (Q + qb - 1) / qb, tasks = B * Hkv * nqb;

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    const int64_t rp_max = (G * qb + ROW_PAD - 1) / ROW_PAD * ROW_PAD, kmax = std::min(kb, K);
    // Per-thread scratch, reused across calls: fresh buffers of a few hundred kB would be new pages every call.
    thread_local std::vector<float> qbuf, acc, sbuf, accmax;
    qbuf.resize(std::max<size_t>(qbuf.size(), rp_max * D));
    acc.resize(std::max<size_t>(acc.size(), rp_max * Dv));
    accmax.resize(std::max<size_t>(accmax.size(), rp_max * Dv));
    sbuf.resize(std::max<size_t>(sbuf.size(), rp_max * kmax));
    // Per-row state, padded rows included (they have no valid key: their weights stay 0).
    std::vector<float> m(rp_max), l(rp_max), R(rp_max), th(rp_max), inv(rp_max), bmax(rp_max), bsum(rp_max),
        bsum2(rp_max);
    std::vector<int32_t> cnt(rp_max), passed(rp_max), lim(rp_max), bcnt(rp_max), bpass(rp_max);
    std::vector<int64_t> cmax(rp_max), n(rp_max);
    std::vector<double> off(rp_max);
    for (int64_t tt = t0; tt < t1; ++tt) {
      // Zig-zag order: causal blocks grow with the query index; pairing short and long ones balances threads.
      const int64_t half = tt / 2, t = (tt % 2 == 0) ? half : tasks - 1 - half;
      const int64_t bh = t / nqb, blk = t % nqb;
      const int64_t b = bh / Hkv, kvh = bh % Hkv, q0 = blk * qb, qc = std::min(qb, Q - q0), rows = G * qc;
      const int64_t rp = (rows + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
      float* QT = qbuf.data();  // (D, rp): row r = g * qc + (i - q0)
      std::memset(QT, 0, sizeof(float) * D * rp);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = Qp + (((b * H) + kvh * G + r / qc) * Q + q0 + r % qc) * D;
        for (int64_t d = 0; d < D; ++d) QT[d * rp + r] = qr[d];
      }
      // Key range of the block: causal up to the last query's position; a mask: its first..last valid key.
      int64_t k_first = 0, k_hi = K - Q + q0 + qc;
      if (!causal) {
        k_first = K; k_hi = 0;
        for (int64_t i = q0; i < q0 + qc; ++i) {
          const bool* mr = Mp + b * ms0 + i * ms1;
          int64_t j = 0;
          while (j < K && !mr[j * ms2]) ++j;
          if (j == K) continue;
          k_first = std::min(k_first, j);
          int64_t e = K - 1;
          while (!mr[e * ms2]) --e;
          k_hi = std::max(k_hi, e + 1);
        }
        if (k_hi <= k_first) { k_first = 0; k_hi = 0; }
      }
      const int64_t k_lo = k_hi == 0 ? 0 : anchor[b] + (k_first - anchor[b]) / kb * kb;
      std::fill(m.begin(), m.end(), NEG);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(R.begin(), R.end(), 0.0f);
      std::fill(cnt.begin(), cnt.end(), 0);
      std::fill(passed.begin(), passed.end(), 0);
      std::fill(cmax.begin(), cmax.end(), 0);
      std::fill(n.begin(), n.end(), 0);
      for (int64_t r = 0; r < rp; ++r) {
        const bool real = r < rows;
        const int64_t g = r / qc, i = q0 + r % qc, h = kvh * G + g;
        th[r] = real && sparse && !skip ? Tp[(b * H + h) * Q + i] : 0.5f * NEG;
        off[r] = real && skip ? OFp[(b * H + h) * Q + i] : 0.0;
        lim[r] = real ? (int32_t)(K - Q + i) : -1;  // causal: the row's last valid key
        if (causal && real) n[r] = K - Q + i + 1;
      }
      float* A = acc.data();
      float* AM = accmax.data();
      std::memset(A, 0, sizeof(float) * rp * Dv);
      std::memset(AM, 0, sizeof(float) * rp * Dv);
      // Post-softmax needs each block's logits twice. Where all of the tile's fit in POST_KEEP_BYTES they are kept
      // from pass 1 for pass 2 (one GEMM instead of two: short and medium rows); else pass 2 recomputes them.
      const bool keep_all = two_pass && (k_hi - k_lo) * rp * (int64_t)sizeof(float) <= POST_KEEP_BYTES;
      if (keep_all) sbuf.resize(std::max<size_t>(sbuf.size(), (k_hi - k_lo) * rp));
      float* S = sbuf.data();  // (kc, rp): the logits of a key block, then its weights
      // Logits of key block [k0, k0 + kc) for every row, invalid keys set to NEG (a mask's valid keys are counted
      // into n when `count`).
      auto logits = [&](int64_t k0, int64_t kc, bool count) {
        gemm<false, false>(kc, rp, D, Kp + b * ks0 + kvh * ks1 + k0 * D, D, QT, rp, S, rp);
        if (causal) {  // only keys past the block's earliest row end need masking (the diagonal block)
          for (int64_t j = std::max<int64_t>(0, K - Q + q0 + 1 - k0); j < kc; ++j) {
            const int32_t key = (int32_t)(k0 + j);
            float* s = S + j * rp;
#pragma omp simd
            for (int64_t r = 0; r < rp; ++r) s[r] = key <= lim[r] ? s[r] : NEG;
          }
        } else {
          for (int64_t j = 0; j < kc; ++j) {
            float* s = S + j * rp;
            for (int64_t r = 0; r < rp; ++r) {
              const bool ok = r < rows && Mp[b * ms0 + (q0 + r % qc) * ms1 + (k0 + j) * ms2];
              if (!ok) s[r] = NEG;
              else if (count) ++n[r];
            }
          }
        }
      };
      // Each row's largest logit in the block, then the online-softmax rescale of the rows it raises (scales l and R,
      // and with `acc` the accumulator; rows still without a kept key restart their maxima's V sum).
      auto block_max = [&](int64_t kc, bool rescale_acc) {
        float* bm = bmax.data();
        std::fill(bm, bm + rp, NEG);
        for (int64_t j = 0; j < kc; ++j) {
          const float* s = S + j * rp;
#pragma omp simd
          for (int64_t r = 0; r < rp; ++r) bm[r] = std::max(bm[r], s[r]);
        }
        for (int64_t r = 0; r < rp; ++r) {
          const float mo = m[r];
          if (!(bm[r] > mo)) continue;
          const float sc = mo > 0.5f * NEG ? expf(mo - bm[r]) : 0.0f;
          l[r] *= sc; R[r] *= sc; m[r] = bm[r];
          if (rescale_acc) {
            float* ar = A + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) ar[d] *= sc;
            if (cnt[r] == 0) { cmax[r] = 0; std::memset(AM + r * Dv, 0, sizeof(float) * Dv); }
          }
        }
      };
      if (two_pass) {
        // Pass 1: each row's maximum m and dense sum l = Σ e^{s−m} (online, no selection).
        for (int64_t k0 = k_lo; k0 < k_hi; k0 += kb) {
          const int64_t kc = std::min(kb, k_hi - k0);
          if (keep_all) S = sbuf.data() + (k0 - k_lo) * rp;
          logits(k0, kc, true);
          block_max(kc, false);
          float* ls = bsum.data();
          std::fill(ls, ls + rp, 0.0f);
          for (int64_t j = 0; j < kc; ++j) {
            const float* s = S + j * rp;
#pragma omp simd
            for (int64_t r = 0; r < rp; ++r) {
              const float e = expf(s[r] - m[r]);  // unconditional: libmvec's expf is for calls outside branches
              ls[r] += s[r] > 0.5f * NEG ? e : 0.0f;
            }
          }
          for (int64_t r = 0; r < rp; ++r) l[r] += ls[r];
        }
        for (int64_t r = 0; r < rp; ++r) inv[r] = 1.0f / std::max(l[r], tiny);
        if (skip) {  // the cut of each row with a valid key (rows without one keep nothing: their th stays below NEG)
          for (int64_t r = 0; r < rows; ++r) {
            if (!(m[r] > 0.5f * NEG)) continue;
            const double exact = std::min((double)m[r] + off[r], (double)m[r]);
            const float c = (float)exact;
            th[r] = (double)c < exact ? std::nextafter(c, std::numeric_limits<float>::infinity()) : c;
          }
        }
        // Pass 2: p = e^{s−m}/l; keep p > θ and the row's maximum (e = 1), as the plain kernel; weights e^{s−m}.
        // Skip-softmax keeps s ≥ cut instead (the maximum among them).
        for (int64_t k0 = k_lo; k0 < k_hi; k0 += kb) {
          const int64_t kc = std::min(kb, k_hi - k0);
          if (keep_all) S = sbuf.data() + (k0 - k_lo) * rp;
          else logits(k0, kc, false);
          float* rs = bsum.data();
          int32_t* c = bcnt.data();
          int32_t* pc = bpass.data();
          std::fill(rs, rs + rp, 0.0f);
          std::fill(c, c + rp, 0);
          std::fill(pc, pc + rp, 0);
          for (int64_t j = 0; j < kc; ++j) {
            float* s = S + j * rp;
#pragma omp simd
            for (int64_t r = 0; r < rp; ++r) {
              const bool valid = s[r] > 0.5f * NEG;
              const float x = expf(s[r] - m[r]), e = valid ? x : 0.0f;
              const bool pass = valid && (skip ? s[r] >= th[r] : e * inv[r] > th[r]);
              const bool keep = pass || (valid && e >= 1.0f);
              const float w = keep ? e : 0.0f;
              rs[r] += w; c[r] += keep ? 1 : 0; pc[r] += pass ? 1 : 0;
              s[r] = w;
            }
          }
          int64_t block_kept = 0;
          for (int64_t r = 0; r < rp; ++r) {
            R[r] += rs[r]; cnt[r] += c[r]; passed[r] += pc[r]; block_kept += c[r];
          }
          accumulate(rows, rp, kc, Dv, S, Vp + b * vs0 + kvh * vs1 + k0 * Dv, A, block_kept);
        }
      }
      else for (int64_t k0 = k_lo; k0 < k_hi; k0 += kb) {  // one pass: online softmax with the selection
        const int64_t kc = std::min(kb, k_hi - k0);
        logits(k0, kc, true);
        block_max(kc, true);
        if (sparse) {  // rows with nothing above θ yet: their maximum may be all they keep (V rows of ties summed)
          for (int64_t r = 0; r < rows; ++r) {
            if (cnt[r] != 0 || !(m[r] > 0.5f * NEG)) continue;
            for (int64_t j = 0; j < kc; ++j) {
              if (S[j * rp + r] == m[r]) {
                const float* vr = Vp + b * vs0 + kvh * vs1 + (k0 + j) * Dv;
                float* amr = AM + r * Dv;
                for (int64_t d = 0; d < Dv; ++d) amr[d] += vr[d];
                ++cmax[r];
              }
            }
          }
        }
        float* ls = bsum.data();
        float* rs = bsum2.data();
        int32_t* c = bcnt.data();
        std::fill(ls, ls + rp, 0.0f);
        std::fill(rs, rs + rp, 0.0f);
        std::fill(c, c + rp, 0);
        for (int64_t j = 0; j < kc; ++j) {
          float* s = S + j * rp;
#pragma omp simd
          for (int64_t r = 0; r < rp; ++r) {
            const bool valid = s[r] > 0.5f * NEG, keep = s[r] > th[r];
            const float x = expf(s[r] - m[r]), e = valid ? x : 0.0f;
            const float w = keep ? e : 0.0f;
            ls[r] += e; rs[r] += w; c[r] += keep ? 1 : 0;
            s[r] = w;
          }
        }
        int64_t block_kept = 0;
        for (int64_t r = 0; r < rp; ++r) {
          l[r] += ls[r]; R[r] += rs[r]; cnt[r] += c[r]; block_kept += c[r];
        }
        accumulate(rows, rp, kc, Dv, S, Vp + b * vs0 + kvh * vs1 + k0 * Dv, A, block_kept);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / qc, i = q0 + r % qc, h = kvh * G + g;
        const int64_t row = (b * H + h) * Q + i;
        float* o = Op + ((b * Q + i) * H + h) * Dv;
        const float* ar = A + r * Dv;
        if (!sparse) {
          const float iv = 1.0f / std::max(l[r], tiny);
          for (int64_t d = 0; d < Dv; ++d) o[d] = ar[d] * iv;
          continue;
        }
        if (post) {  // dense probabilities of the kept keys: no renormalisation, β = the dropped probability mass
          const float kept = R[r] * inv[r];
          const float beta = (vmc && n[r] > 0) ? 1.0f - kept : 0.0f;
          const float* vb = vmc ? VBp + (((b * Hkv + kvh) * Q) + i) * Dv : nullptr;
          for (int64_t d = 0; d < Dv; ++d) o[d] = ar[d] * inv[r] + (vmc ? beta * vb[d] : 0.0f);
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
