#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common.h"
// The largest logit of row x (K); a row with no valid key (or a NaN) gets weights 0 and returns -inf or NaN.
static inline float row_max(float* x, int64_t K) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max:m)
  for (int64_t j = 0; j < K; ++j) m = x[j] > m ? x[j] : m;
  if (!(m > -std::numeric_limits<float>::infinity()))
    for (int64_t j = 0; j < K; ++j) x[j] = 0.0f;
  return m;
}

// The checks every post-softmax kernel below makes of its (R, K) scores, its (R) whole-row flags and (R) float32
// per-row parameters (theta, cut; undefined where the kernel has none).
static void check_rows(const torch::Tensor& s, const torch::Tensor& whole, const torch::Tensor& per_row = torch::Tensor()) {
  TORCH_CHECK(s.device().is_cpu() && whole.device().is_cpu() && (!per_row.defined() || per_row.device().is_cpu()), "toptheta: a CPU kernel was handed tensors on another device; the backend registry must not choose it there");
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == torch::kFloat32 && s.is_contiguous(), "s: (R, K) float32 contiguous");
  TORCH_CHECK(whole.scalar_type() == torch::kBool && whole.is_contiguous() && whole.numel() == s.size(0), "whole: (R) bool");
  TORCH_CHECK(!per_row.defined() || (per_row.scalar_type() == torch::kFloat32 && per_row.is_contiguous() && per_row.numel() == s.size(0)), "per-row parameter (theta, cut): (R) float32");
}

// In place on row x (K) with maximum m: w = softmax(x) * [x >= b]; returns the kept sum and count in ks, kc.
static inline void keep_at_or_above(float* x, int64_t K, float m, float b, float& ks, int32_t& kc) {
  float sum = 0.0f;
#pragma omp simd reduction(+:sum)
  for (int64_t j = 0; j < K; ++j) sum += expf(x[j] - m);
  const float inv = 1.0f / sum;
  ks = 0.0f; kc = 0;
#pragma omp simd reduction(+:ks, kc)
  for (int64_t j = 0; j < K; ++j) {
    bool keep = x[j] >= b;
    float w = keep ? expf(x[j] - m) * inv : 0.0f;
    x[j] = w; ks += w; kc += keep ? 1 : 0;
  }
}

// The loop every post-softmax kernel below shares: for each row x of s (R, K), in parallel, its maximum m; a row
// without a valid key keeps nothing (weights 0, kept sum and count 0), the others are handed to
// row(r, x, m, scratch, kept_sum, kept_count), scratch a Scratch(K) per thread. Returns (kept_sum, kept_count).
struct NoScratch { explicit NoScratch(int64_t) {} };

template <typename Scratch, typename Row>
static std::vector<torch::Tensor> each_row(const torch::Tensor& s, Row row) {
  const int64_t R = s.size(0), K = s.size(1);
  auto kept_sum = torch::empty({R}, s.options());
  auto kept_count = torch::empty({R}, s.options().dtype(torch::kInt32));
  float* S = s.data_ptr<float>();
  float* KS = kept_sum.data_ptr<float>();
  int32_t* KC = kept_count.data_ptr<int32_t>();
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    Scratch scratch(K);
    for (int64_t r = r0; r < r1; ++r) {
      float* x = S + r * K;
      const float m = row_max(x, K);
      if (!(m > -std::numeric_limits<float>::infinity())) {
        KS[r] = 0.0f; KC[r] = 0;
        continue;
      }
      row(r, x, m, scratch, KS[r], KC[r]);
    }
  });
  return {kept_sum, kept_count};
}

// s: (R, K) float32 contiguous scaled logits, -inf where invalid. theta: (R) float32. whole: (R) bool.
// In place, each row becomes w = p * [p > cut] with p = softmax(row) and cut = min(theta, just below the
// row's largest p) (so the maximum is always kept); rows marked whole keep every p (invalid keys hold 0).
// Returns (kept_sum (R) float32: sum of w, kept_count (R) int32: kept keys of rows not marked whole,
// empty (R) bool: rows not marked whole where no p passes theta, i.e. only the maximum was kept).
std::vector<torch::Tensor> post_threshold(torch::Tensor s, torch::Tensor theta, torch::Tensor whole) {
  check_rows(s, whole, theta);
  const int64_t K = s.size(1);
  auto empty = torch::zeros({s.size(0)}, s.options().dtype(torch::kBool));  // rows without a valid key: false
  const float* T = theta.data_ptr<float>();
  const bool* W = whole.data_ptr<bool>();
  bool* E = empty.data_ptr<bool>();
  auto kept = each_row<NoScratch>(s, [&](int64_t r, float* x, float m, NoScratch&, float& KS, int32_t& KC) {
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < K; ++j) { float e = expf(x[j] - m); x[j] = e; sum += e; }
    const float inv = 1.0f / sum;
    float cut = W[r] ? -1.0f : std::fmin(T[r], std::nextafter(inv, 0.0f));  // the max has p = 1 * inv
    E[r] = !W[r] && !(inv > T[r]);
    float ks = 0.0f; int32_t kc = 0;
#pragma omp simd reduction(+:ks, kc)
    for (int64_t j = 0; j < K; ++j) {
      float p = x[j] * inv;
      bool keep = p > cut;
      float w = keep ? p : 0.0f;
      x[j] = w; ks += w; kc += keep ? 1 : 0;
    }
    KS = ks; KC = kc;
  });
  return {kept[0], kept[1], empty};
}

// s: (R, K) float32 contiguous scaled logits, -inf where invalid; whole: (R) bool. In place, each row becomes
// w = p * [kept] with p = softmax(row): rows not marked whole keep their k largest logits (of equal logits at the
// k-th value, the first in key order), rows marked whole every p. Returns (kept_sum (R) float32, kept_count (R)
// int32; for rows marked whole it counts all K columns, invalid ones included: the caller knows their n).
static constexpr int64_t SAMPLE = 128;  // keys sampled per row to place the top-k selection's pivot

// Copies the keys of x (K) above pivot to out (room for K + 8), in order; returns their number.
static int64_t compact_above(const float* x, int64_t K, float pivot, float* out) {
  int64_t c = 0, j = 0;
#if defined(__AVX2__)
  static const auto lanes = [] {  // for each 8-bit mask, the lanes it selects, packed to the front
    std::array<std::array<int32_t, 8>, 256> t{};
    for (int m = 0; m < 256; ++m)
      for (int i = 0, n = 0; i < 8; ++i)
        if (m >> i & 1) t[m][n++] = i;
    return t;
  }();
  const __m256 p = _mm256_set1_ps(pivot);
  for (; j + 8 <= K; j += 8) {  // branch-free: the store always happens, c advances by the lanes kept
    const __m256 v = _mm256_loadu_ps(x + j);
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, p, _CMP_GT_OQ));
    const __m256i idx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes[mask].data()));
    _mm256_storeu_ps(out + c, _mm256_permutevar8x32_ps(v, idx));
    c += __builtin_popcount(mask);
  }
#endif
  for (; j < K; ++j) { out[c] = x[j]; c += x[j] > pivot ? 1 : 0; }
  return c;
}

struct TopkScratch {  // the selection's candidates, then the row's exp(s - m)
  std::vector<float> e;
  explicit TopkScratch(int64_t K) : e(K + 8) {}
};

std::vector<torch::Tensor> post_topk(torch::Tensor s, int64_t k, torch::Tensor whole) {
  check_rows(s, whole);
  TORCH_CHECK(k >= 1, "k >= 1");
  const int64_t K = s.size(1);
  const bool* W = whole.data_ptr<bool>();
  return each_row<TopkScratch>(s, [&](int64_t r, float* x, float m, TopkScratch& scratch, float& KS, int32_t& KC) {
    float* e = scratch.e.data();
    const bool all = W[r] || k >= K;
    float tau = -std::numeric_limits<float>::infinity();  // keep x > tau, and `ties` of the keys equal to it
    int64_t ties = 0, equal = 0;
    if (!all) {
      // The candidates: keys above a pivot that a strided sample puts a few k from the top (about 4k keys
      // pass, at least 4 / SAMPLE of the row); where that is most of the row, or fewer than k pass, every key
      // is a candidate. The k-th largest candidate is the row's.
      int64_t c = 0;
      const int64_t q = std::max<int64_t>(4, 4 * k * SAMPLE / K);
      if (q < SAMPLE / 4) {
        float sample[SAMPLE];
        for (int64_t i = 0; i < SAMPLE; ++i) sample[i] = x[i * K / SAMPLE];
        std::nth_element(sample, sample + q, sample + SAMPLE, std::greater<float>());
        c = compact_above(x, K, sample[q], e);
      }
      if (c < k) {
        std::copy(x, x + K, e);
        c = K;
      }
      std::nth_element(e, e + (k - 1), e + c, std::greater<float>());
      tau = e[k - 1];
      int64_t above = 0;  // every key >= tau is a candidate
      for (int64_t j = 0; j < c; ++j) { above += e[j] > tau ? 1 : 0; equal += e[j] == tau ? 1 : 0; }
      ties = k - above;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < K; ++j) { float v = expf(x[j] - m); e[j] = v; sum += v; }
    const float inv = 1.0f / sum;
    float ks = 0.0f; int32_t kc = 0;
    if (all || ties == equal) {  // no tie to break (the usual case): one comparison per key
#pragma omp simd reduction(+:ks, kc)
      for (int64_t j = 0; j < K; ++j) {
        bool keep = all || x[j] >= tau;
        float w = keep ? e[j] * inv : 0.0f;
        x[j] = w; ks += w; kc += keep ? 1 : 0;
      }
    } else {
      for (int64_t j = 0; j < K; ++j) {
        bool keep = x[j] > tau || (x[j] == tau && ties > 0);
        if (x[j] == tau && keep) --ties;
        float w = keep ? e[j] * inv : 0.0f;
        x[j] = w; ks += w; kc += keep ? 1 : 0;
      }
    }
    KS = ks; KC = kc;
  });
}

// s: (R, K) float32 contiguous scaled logits, -inf where invalid; p in (0, 1); whole: (R) bool. In place, each row
// becomes w = softmax(row) * [x >= b], b the row's nucleus boundary: the smallest logit v whose strictly larger keys
// hold less than p of the row's mass, Σ_{x > v} e < p Σ e with e = exp(x - m) in double (the keys ranked by logit,
// the shortest prefix reaching p, plus every key tied with its last one); rows marked whole keep every p. The
// boundary comes from a selection on the logits (expected O(K)), not a sort: partition the candidates around a
// pivot; if the keys above it (and those already known above every candidate) hold less than p, the pivot
// qualifies and the boundary lies at or below it, else above it. The masses are summed in another order than a
// sorted prefix sum, so a row whose cumulative mass lies within double rounding of p may decide differently.
// Returns (kept_sum (R) float32, kept_count (R) int32; for rows marked whole it counts all K columns).
struct ToppScratch {  // the row's valid logits and their masses exp(x - m), in double
  std::vector<float> val;
  std::vector<double> mass;
  explicit ToppScratch(int64_t K) : val(K), mass(K) {}
};

std::vector<torch::Tensor> post_topp(torch::Tensor s, double p, torch::Tensor whole) {
  check_rows(s, whole);
  TORCH_CHECK(p > 0.0 && p < 1.0, "p in (0, 1)");
  const int64_t K = s.size(1);
  const bool* W = whole.data_ptr<bool>();
  return each_row<ToppScratch>(s, [&](int64_t r, float* x, float m, ToppScratch& scratch, float& KS, int32_t& KC) {
    std::vector<float>& val = scratch.val;
    std::vector<double>& mass = scratch.mass;
    float b = -std::numeric_limits<float>::infinity();  // keep x >= b
    if (!W[r]) {
      int64_t c = 0;
      double total = 0.0;
      for (int64_t j = 0; j < K; ++j) {
        if (x[j] > -std::numeric_limits<float>::infinity()) {
          val[c] = x[j]; mass[c] = std::exp(static_cast<double>(x[j]) - static_cast<double>(m)); total += mass[c]; ++c;
        }
      }
      const double target = p * total;
      double above = 0.0;  // mass of the keys above every candidate
      int64_t lo = 0, hi = c;  // candidates: val[lo, hi)
      b = m;  // the maximum always qualifies: nothing lies above it
      while (lo < hi) {
        const float pivot = val[lo + (hi - lo) / 2];
        // three-way partition of [lo, hi): greater | equal | less, with their masses
        int64_t g = lo, i = lo, l = hi;
        double mg = 0.0, me = 0.0;
        while (i < l) {
          if (val[i] > pivot) { std::swap(val[i], val[g]); std::swap(mass[i], mass[g]); mg += mass[g]; ++g; ++i; }
          else if (val[i] < pivot) { --l; std::swap(val[i], val[l]); std::swap(mass[i], mass[l]); }
          else { me += mass[i]; ++i; }
        }
        if (above + mg < target) {  // the pivot qualifies: the boundary is it or a smaller logit
          b = pivot; above += mg + me; lo = l;
        } else {  // the keys above the pivot already hold p: the boundary lies among them
          hi = g;
        }
      }
    }
    keep_at_or_above(x, K, m, b, KS, KC);
  });
}

// s: (R, K) float32 contiguous scaled logits, -inf where invalid; cut: (R) float32 logits; whole: (R) bool. In place,
// each row becomes w = softmax(row) * [x >= cut] (skip-softmax's rule, the cut never above the row's maximum); rows
// marked whole keep every p. Returns (kept_sum (R) float32, kept_count (R) int32; rows marked whole count all K).
std::vector<torch::Tensor> post_cut(torch::Tensor s, torch::Tensor cut, torch::Tensor whole) {
  check_rows(s, whole, cut);
  const int64_t K = s.size(1);
  const float* C = cut.data_ptr<float>();
  const bool* W = whole.data_ptr<bool>();
  return each_row<NoScratch>(s, [&](int64_t r, float* x, float m, NoScratch&, float& KS, int32_t& KC) {
    keep_at_or_above(x, K, m, W[r] ? -std::numeric_limits<float>::infinity() : C[r], KS, KC);
  });
}
