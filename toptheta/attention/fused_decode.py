"""The C++ decode kernel behind ``decode.py``: one query row per sequence over a KV cache, in two passes.

Tasks are (sequence, KV head, block of keys), so a single sequence with few KV heads still fills the threads.
Pass 1 reads each K row once and computes the G query heads' logits from it (stored, B·H·K floats), each
block's maximum, Σ e^{s−max} and, for pre-softmax θ, how many logits pass θ. The blocks are merged per row
into m and l. Pass 2 decides per key and head, as the plain kernel does: pre-softmax keep s > θ (a row where
nothing passed keeps its maximum), post-softmax keep p = e^{s−m}/l > θ and the maximum; and reads a V row
only when one of the G heads keeps it, accumulating e^{s−m}·v per head. The rows are finished with the plain
kernel's formulas (renormalised over the kept set + SDC for pre, dense probabilities for post, β·v̄ for VMC),
and the kernel reports per row the kept count, the kept dense mass, whether it was empty, and per (sequence,
KV head) the number of V rows read (the union over its heads): the statistics the plain kernel derives from
its keep mask. Built on first use like the other kernels (``fused.build``); None where it cannot be built.
"""

from __future__ import annotations

import functools

from .fused import PARALLEL_PROBE, VECTOR_EXPF, build

_VERSION = 2  # bump when _SOURCE or the flags change: the build cache is keyed by name

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <vector>
""" + VECTOR_EXPF + PARALLEL_PROBE + r"""
static constexpr float NEG = -1.0e30f;  // "no key" (exp of it minus a row max gives 0)

// q (B, H, D) float32 contiguous, scaled. k (B, Hkv, K, D), v (B, Hkv, K, Dv): float32, unit stride in the last
// dimension, any other strides (a cache's views). valid (B, K) bool or empty (every key valid).
// theta (B, H): θ (logit units for pre, probability units for post; -1e29 keeps every valid key), or empty: dense.
// raw (B, H): θ as calibrated (exp-threshold SDC), cal (B, H): calibrated dropped mass. vbar (B, Hkv, Dv): v̄ (VMC).
// sdc: 0 none, 1 exact, 2 exp-threshold, 3 calibrated (pre only); lam = λ. kb: keys per task.
// Returns out (B, H, Dv), rowstats (B, H, 3): kept count, kept dense mass, empty; vrows (B, Hkv): V rows read.
std::vector<torch::Tensor> decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor valid,
                                  torch::Tensor theta, torch::Tensor raw, torch::Tensor cal, torch::Tensor vbar,
                                  bool vmc, int64_t sdc, double lam, bool post, int64_t kb) {
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
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / nkb, blk = t % nkb, b = bh / Hkv, kvh = bh % Hkv;
      const int64_t j0 = blk * kb, j1 = std::min(K, j0 + kb);
      const float* kbase = Kp + b * k0s + kvh * k1s;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const float* qr = Qp + (b * H + h) * D;
        float* s = Sp + (b * H + h) * K;
        for (int64_t j = j0; j < j1; ++j) {
          const float* kr = kbase + j * k2s;
          float dot = 0.0f;
#pragma omp simd reduction(+:dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
          s[j] = (masked && !Mp[b * K + j]) ? NEG : dot;
        }
        float mx = NEG;
        for (int64_t j = j0; j < j1; ++j) mx = std::max(mx, s[j]);
        float sum = 0.0f;
        if (mx > 0.5f * NEG) {
#pragma omp simd reduction(+:sum)
          for (int64_t j = j0; j < j1; ++j) sum += expf(s[j] - mx);
        }
        int64_t pass = 0, nvalid = 0;
        const float th = sparse ? Tp[b * H + h] : 0.0f;
        for (int64_t j = j0; j < j1; ++j) {
          const bool ok = s[j] > 0.5f * NEG;
          nvalid += ok;
          pass += (ok && !post && sparse && s[j] > th);
        }
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
      int64_t reads = 0;
      for (int64_t j = 0; j < nj; ++j) {
        bool any = false;
        for (int64_t g = 0; g < G; ++g) any |= keepf[g * kb + j] != 0;
        if (!any) continue;  // no head of the group kept this key: its V row is never read
        ++reads;
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
  return {out, rowstats, vrows};
}
"""


@functools.cache
def extension():
    """The compiled module, or None where it cannot be built (no compiler, TOPTHETA_FUSED=0)."""
    return build(f"toptheta_decode_v{_VERSION}", _SOURCE, ["decode"], "the decode kernel", "the torch decode path")
