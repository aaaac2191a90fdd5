#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <vector>
#include "common.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
static constexpr float NEG = -1.0e30f;  // "no key" (exp of it minus a row max gives 0)

// One decode step's statistics added to a layer's packed float64 row, as SparsityStats.update would add them from
// rowstats and vrows: per head the kept and valid elements, the live rows, the dropped mass and the empty rows (these
// two of sparse rows only), per KV head the V rows read and valid, and one step. Sums over the batch are taken in
// float32 for the dropped mass, exactly as the Python update does, then added in float64.
static void add_step_counts(torch::Tensor srow, const std::vector<int64_t>& cols, const torch::Tensor& rowstats,
                            const torch::Tensor& vrows, const std::vector<int64_t>& n, int64_t B, int64_t H,
                            int64_t Hkv, bool sparse, int64_t kmin) {
  TORCH_CHECK(srow.device().is_cpu() && srow.scalar_type() == torch::kFloat64 && srow.is_contiguous() && cols.size() == 8,
              "srow: a contiguous float64 CPU row and 8 column offsets (decode_kept, decode_valid, vrow_kept, "
              "vrow_valid, dropped_mass, rows, decode_steps, empty_rows)");
  double* S = srow.data_ptr<double>();
  const float* RS = rowstats.data_ptr<float>();
  const int64_t* VR = vrows.data_ptr<int64_t>();
  int64_t valid = 0, live = 0;
  for (int64_t b = 0; b < B; ++b) { valid += n[b * H]; live += n[b * H] > 0; }
  for (int64_t h = 0; h < H; ++h) {
    int64_t kept = 0, empty = 0;
    float dropped = 0.0f;
    for (int64_t b = 0; b < B; ++b) {
      const float* r = RS + 3 * (b * H + h);
      kept += (int64_t)r[0];
      if (sparse && n[b * H] > 0) dropped += std::max(1.0f - r[1], 0.0f);
      empty += sparse && r[2] != 0.0f && n[b * H] > kmin;
    }
    S[cols[0] + h] += (double)kept;
    S[cols[1] + h] += (double)valid;
    S[cols[5] + h] += (double)live;
    if (sparse) { S[cols[4] + h] += (double)dropped; S[cols[7] + h] += (double)empty; }
  }
  for (int64_t g = 0; g < Hkv; ++g) {
    int64_t reads = 0;
    for (int64_t b = 0; b < B; ++b) reads += VR[b * Hkv + g];
    S[cols[2] + g] += (double)reads;
    S[cols[3] + g] += (double)valid;
  }
  S[cols[6]] += 1.0;
}

// s_g[j] = q_g · k_j for the G query heads of one KV head (q: G rows of D floats) and the keys j0 ≤ j < j1 (rows of k
// ks floats apart). Four keys at a time: each is loaded once from memory and reused from L1 by the G heads, and the
// four independent accumulators hide the FMA latency a one-key dot product waits on (the loop runs at the loads'
// pace, not the FMA chain's); their lanes are summed together at the end.
static void block_logits(const float* q, int64_t G, int64_t D, const float* kbase, int64_t ks, int64_t j0,
                         int64_t j1, float* const* s) {
  int64_t j = j0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (; j + 4 <= j1; j += 4) {
      const float* k0 = kbase + j * ks;
      const float* k1 = k0 + ks;
      const float* k2 = k1 + ks;
      const float* k3 = k2 + ks;
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = q + g * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qr + d);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
        }
        // lanes of a0..a3 summed: {Σa0, Σa1, Σa2, Σa3}
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_storeu_ps(s[g] + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      }
    }
  }
#endif
  for (; j < j1; ++j) {
    const float* kr = kbase + j * ks;
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = q + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+:dot)
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
      s[g][j] = dot;
    }
  }
}

// q (B, H, D) float32 contiguous, scaled. k (B, Hkv, K, D), v (B, Hkv, K, Dv): float32, unit stride in the last
// dimension, any other strides (a cache's views). valid (B, K) bool or empty (every key valid).
// theta (B, H): θ (logit units for pre, probability units for post; -1e29 keeps every valid key), or empty: dense.
// raw (B, H): θ as calibrated (exp-threshold SDC), cal (B, H): calibrated dropped mass. vbar (B, Hkv, Dv): v̄ (VMC).
// sdc: 0 none, 1 exact, 2 exp-threshold, 3 calibrated (pre only); lam = λ. kb: keys per task.
// Returns out (B, H, Dv), rowstats (B, H, 3): kept count, kept dense mass, empty; vrows (B, Hkv): V rows read.
// srow: a layer's packed float64 statistics row (stats.SparsityStats.decode_row) the step's counts are added to, or
// empty; cols: its columns' first indices in the order of stats.DECODE_COLUMNS; kmin: the layer's k (a row counts as
// empty only when it holds more valid keys than that, as the plain kernel's statistics).
std::vector<torch::Tensor> decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor valid,
                                  torch::Tensor theta, torch::Tensor raw, torch::Tensor cal, torch::Tensor vbar,
                                  bool vmc, int64_t sdc, double lam, bool post, int64_t kb, torch::Tensor srow,
                                  std::vector<int64_t> cols, int64_t kmin) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k.size(1), K = k.size(2), Dv = v.size(3), G = H / Hkv;
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && valid.device().is_cpu() && theta.device().is_cpu() && raw.device().is_cpu() && cal.device().is_cpu() && vbar.device().is_cpu(), "toptheta: a CPU kernel was handed tensors on another device; the backend registry must not choose it there");
  TORCH_CHECK(q.is_contiguous() && q.scalar_type() == torch::kFloat32, "q: (B, H, D) float32 contiguous");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32 && k.stride(3) == 1 &&
              v.stride(3) == 1, "k, v: float32 with unit stride in the last dimension");
  const bool sparse = theta.numel() > 0, masked = valid.numel() > 0;
  const int64_t nkb = (K + kb - 1) / kb, tasks = B * Hkv * nkb;
  auto opts = q.options();
  auto S = torch::empty({B, H, K}, opts);
  // Per task and head: block max, Σ e^{s−max}, logits passing θ (pre), valid keys.
  auto part = torch::empty({tasks, G, 4}, opts);
  auto acc = torch::zeros({tasks, G, Dv}, opts);  // Σ kept e^{s−m}·v of the block
  auto kept = torch::zeros({tasks, G, 2}, opts);  // Σ kept e^{s−m}, kept count
  auto vread = torch::zeros({tasks}, opts.dtype(torch::kLong));
  const float* Qp = q.data_ptr<float>();
  const float* Kp = k.data_ptr<float>();
  const float* Vp = v.data_ptr<float>();
  const int64_t k0s = k.stride(0), k1s = k.stride(1), k2s = k.stride(2);
  const int64_t v0s = v.stride(0), v1s = v.stride(1), v2s = v.stride(2);
  const bool* Mp = masked ? valid.data_ptr<bool>() : nullptr;
  const float* Tp = sparse ? theta.data_ptr<float>() : nullptr;
  float* Sp = S.data_ptr<float>();
  float* Pp = part.data_ptr<float>();

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float*> srows(G);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / nkb, blk = t % nkb, b = bh / Hkv, kvh = bh % Hkv;
      const int64_t j0 = blk * kb, j1 = std::min(K, j0 + kb);
      for (int64_t g = 0; g < G; ++g) srows[g] = Sp + (b * H + kvh * G + g) * K;
      block_logits(Qp + (b * H + kvh * G) * D, G, D, Kp + b * k0s + kvh * k1s, k2s, j0, j1, srows.data());
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        float* s = srows[g];
        if (masked)
          for (int64_t j = j0; j < j1; ++j) s[j] = Mp[b * K + j] ? s[j] : NEG;
        float mx = NEG;
        for (int64_t j = j0; j < j1; ++j) mx = std::max(mx, s[j]);
        float sum = 0.0f;
        if (mx > 0.5f * NEG) {
#pragma omp simd reduction(+:sum)
          for (int64_t j = j0; j < j1; ++j) sum += expf(s[j] - mx);
        }
        int64_t pass = 0, nvalid = masked ? 0 : j1 - j0;
        const float th = sparse ? Tp[b * H + h] : 0.0f;
        if (masked)
          for (int64_t j = j0; j < j1; ++j) nvalid += s[j] > 0.5f * NEG;
        if (sparse && !post)  // (θ on logits never passes a masked key: θ is finite, masked logits are NEG)
          for (int64_t j = j0; j < j1; ++j) pass += s[j] > th && s[j] > 0.5f * NEG;
        float* pr = Pp + (t * G + g) * 4;
        pr[0] = mx; pr[1] = sum; pr[2] = (float)pass; pr[3] = (float)nvalid;
      }
    }
  });

  // Merge the blocks of each row: m, l, passes (pre), valid keys.
  std::vector<float> m(B * H, NEG), l(B * H, 0.0f);
  std::vector<int64_t> passed(B * H, 0), n(B * H, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t kvh = h / G, g = h % G, row = b * H + h;
      float mx = NEG;
      for (int64_t blk = 0; blk < nkb; ++blk) mx = std::max(mx, Pp[(((b * Hkv + kvh) * nkb + blk) * G + g) * 4]);
      float sum = 0.0f;
      for (int64_t blk = 0; blk < nkb; ++blk) {
        const float* pr = Pp + (((b * Hkv + kvh) * nkb + blk) * G + g) * 4;
        if (pr[0] > 0.5f * NEG) sum += pr[1] * expf(pr[0] - mx);
        passed[row] += (int64_t)pr[2];
        n[row] += (int64_t)pr[3];
      }
      m[row] = mx; l[row] = sum;
    }
  const float tiny = std::numeric_limits<float>::min();

  float* Ap = acc.data_ptr<float>();
  float* KP = kept.data_ptr<float>();
  int64_t* VR = vread.data_ptr<int64_t>();
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> keepf(G * kb);  // this block's keep flags per head: the V rows to read are their union
    std::vector<int64_t> union_idx(kb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / nkb, blk = t % nkb, b = bh / Hkv, kvh = bh % Hkv;
      const int64_t j0 = blk * kb, j1 = std::min(K, j0 + kb), nj = j1 - j0;
      float* KPt = KP + t * G * 2;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = b * H + kvh * G + g;
        // 0 keep every valid key, 1 pre: s > θ, 2 pre, nothing passed: the maximum, 3 post: p > θ or the maximum
        const int rule = !sparse ? 0 : post ? 3 : (passed[row] > 0 ? 1 : 2);
        const float th = sparse ? Tp[row] : 0.0f, inv = 1.0f / std::max(l[row], tiny), mr = m[row];
        float* s = Sp + row * K + j0;
        uint8_t* kf = keepf.data() + g * kb;
        float rs = 0.0f;
        int64_t c = 0;
#pragma omp simd reduction(+:rs, c)
        for (int64_t j = 0; j < nj; ++j) {
          const float sj = s[j], e = expf(sj - mr);
          const bool ok = sj > 0.5f * NEG;
          const bool keep = ok && (rule == 0 || (rule == 1 && sj > th) || (rule == 2 && sj == mr) ||
                                   (rule == 3 && (e * inv > th || e >= 1.0f)));
          const float wv = keep ? e : 0.0f;
          kf[j] = keep ? 1 : 0; s[j] = wv; rs += wv; c += keep ? 1 : 0;
        }
        KPt[2 * g] += rs; KPt[2 * g + 1] += (float)c;
      }
      const float* vbase = Vp + b * v0s + kvh * v1s;
      float* A = Ap + t * G * Dv;
      // The V rows to read: the union of the G heads' keep flags, compacted (a key no head kept is never read).
      for (int64_t g = 1; g < G; ++g)
        for (int64_t j = 0; j < nj; ++j) keepf[j] |= keepf[g * kb + j];
      int64_t reads = 0;
      for (int64_t j = 0; j < nj; ++j) {
        union_idx[reads] = j;
        reads += keepf[j] != 0;
      }
      for (int64_t i = 0; i < reads; ++i) {
        const int64_t j = union_idx[i];
        if (i + 4 < reads) {  // scattered rows: ask for a later one's cache lines early
          const float* ahead = vbase + (j0 + union_idx[i + 4]) * v2s;
          for (int64_t d = 0; d < Dv; d += 16) __builtin_prefetch(ahead + d);
        }
        const float* vr = vbase + (j0 + j) * v2s;
        for (int64_t g = 0; g < G; ++g) {
          const float wg = Sp[(b * H + kvh * G + g) * K + j0 + j];
          if (wg == 0.0f) continue;
          float* a = A + g * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) a[d] += wg * vr[d];
        }
      }
      VR[t] = reads;
    }
  });

  auto out = torch::zeros({B, H, Dv}, opts);
  auto rowstats = torch::zeros({B, H, 3}, opts);
  auto vrows = torch::zeros({B, Hkv}, opts.dtype(torch::kLong));
  float* Op = out.data_ptr<float>();
  float* RSp = rowstats.data_ptr<float>();
  int64_t* VRo = vrows.data_ptr<int64_t>();
  const float* RTp = sdc == 2 ? raw.data_ptr<float>() : nullptr;
  const float* Cp = sdc == 3 ? cal.data_ptr<float>() : nullptr;
  const float* VBp = vmc ? vbar.data_ptr<float>() : nullptr;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
      for (int64_t blk = 0; blk < nkb; ++blk) VRo[b * Hkv + kvh] += VR[(b * Hkv + kvh) * nkb + blk];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g, row = b * H + h;
        float R = 0.0f, c = 0.0f;
        float* o = Op + row * Dv;
        for (int64_t blk = 0; blk < nkb; ++blk) {
          const int64_t t = (b * Hkv + kvh) * nkb + blk;
          R += KP[(t * G + g) * 2]; c += KP[(t * G + g) * 2 + 1];
          const float* a = Ap + (t * G + g) * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += a[d];
        }
        const float* vb = vmc ? VBp + (b * Hkv + kvh) * Dv : nullptr;
        float denom, beta = 0.0f, mass_kept;
        if (!sparse || post) {  // dense probabilities (of the kept keys)
          denom = std::max(l[row], tiny);
          mass_kept = R / denom;
          if (sparse && vmc && n[row] > 0) beta = 1.0f - mass_kept;
        } else {  // pre: renormalised over the kept set, SDC adds the dropped mass back
          float mass = 0.0f;
          const int64_t ci = (int64_t)c;
          if (sdc == 1) mass = std::max(l[row] - R, 0.0f);
          else if (sdc == 2 && n[row] > ci) mass = (float)(n[row] - ci) * expf(std::min(RTp[row], m[row]) - m[row]);
          else if (sdc == 3 && ci < n[row]) mass = Cp[row];
          denom = std::max(R + (float)lam * mass, tiny);
          mass_kept = R / std::max(l[row], tiny);
          if (vmc && n[row] > 0) beta = 1.0f - R / denom;
        }
        for (int64_t d = 0; d < Dv; ++d) o[d] = o[d] / denom + (beta != 0.0f ? beta * vb[d] : 0.0f);
        RSp[3 * row] = c;
        RSp[3 * row + 1] = mass_kept;
        // post: the maximum's p is 1/l, every other p is smaller: nothing passed θ iff 1/l ≤ θ
        const bool empty = sparse && n[row] > 0 && (post ? !(1.0f / std::max(l[row], tiny) > Tp[row]) : passed[row] == 0);
        RSp[3 * row + 2] = empty ? 1.0f : 0.0f;
      }
    }
  if (srow.numel() > 0) add_step_counts(srow, cols, rowstats, vrows, n, B, H, Hkv, sparse, kmin);
  return {out, rowstats, vrows};
}
