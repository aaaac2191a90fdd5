"""An optional fused CPU kernel for selection after the softmax (the Top-θ and Top-k post-softmax hot paths).

The pure-torch path makes five passes over a chunk's (Qc, Kc) scores between its two GEMMs: softmax,
row maximum, comparison, zeroing and row sum. Here one C++ loop does all of it row by row while the
row (≤ 32 kB for 8k keys) sits in L1: max, exp and sum, then p > cut, zeroing and the kept sum and
count. Top-k first finds each row's k-th largest logit: the keys above a pivot placed by a strided sample of the
row (about 4k of them; an AVX2 compaction copies them out) go through ``std::nth_element``, the whole row only where
fewer than k pass; then it keeps the logits above that value, as the torch path (``torch.topk``) keeps the k largest.
It is compiled on first use with torch's C++ extension tooling (g++; about a minute, cached in
``~/.cache/torch_extensions``); where that fails the kernel keeps the torch path and says so once.

Set ``TOPTHETA_FUSED=0`` to disable it (the torch path is the reference; tests compare the two).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from ..sparsifiers.base import FusedRule

log = logging.getLogger("toptheta")
_VERSION = 10  # bump when _SOURCE or the flags change: the build cache is keyed by name

# Kernels are built without -ffinite-math-only (see build()): masked keys hold -inf and rely on exp(-inf) = 0 and IEEE
# comparisons. GCC still vectorises expf through glibc's libmvec when told the vector variants exist (glibc declares
# them only under __FAST_MATH__); libmvec handles -inf and the other special inputs exactly like the scalar expf.
# Every kernel source includes this after <cmath>.
VECTOR_EXPF = r"""
#if defined(__x86_64__) && defined(__GLIBC__)
extern "C" float expf(float) noexcept __attribute__((__simd__("notinbranch")));
#endif
"""

# Every kernel exports this probe: how many threads its at::parallel_for really uses. ATen's OpenMP backend runs
# parallel_for through `#pragma omp parallel` in a header, so an extension built without -fopenmp runs every
# task on the calling thread, silently (both kernels did until this probe's test existed).
PARALLEL_PROBE = r"""
#include <ATen/Parallel.h>
#include <atomic>
int64_t parallel_threads(int64_t tasks) {
  std::atomic<int64_t> most{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    const int64_t mine = at::get_thread_num() + 1;
    int64_t seen = most.load();
    while (mine > seen && !most.compare_exchange_weak(seen, mine)) {}
  });
  return most.load();
}
"""

_SOURCE = r"""
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

""" + VECTOR_EXPF + PARALLEL_PROBE + r"""
// The largest logit of row x (K); a row with no valid key (or a NaN) gets weights 0 and returns -inf or NaN.
static inline float row_max(float* x, int64_t K) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max:m)
  for (int64_t j = 0; j < K; ++j) m = x[j] > m ? x[j] : m;
  if (!(m > -std::numeric_limits<float>::infinity()))
    for (int64_t j = 0; j < K; ++j) x[j] = 0.0f;
  return m;
}

// s: (R, K) float32 contiguous scaled logits, -inf where invalid. theta: (R) float32. whole: (R) bool.
// In place, each row becomes w = p * [p > cut] with p = softmax(row) and cut = min(theta, just below the
// row's largest p) (so the maximum is always kept); rows marked whole keep every p (invalid keys hold 0).
// Returns (kept_sum (R) float32: sum of w, kept_count (R) int32: kept keys of rows not marked whole,
// empty (R) bool: rows not marked whole where no p passes theta, i.e. only the maximum was kept).
std::vector<torch::Tensor> post_threshold(torch::Tensor s, torch::Tensor theta, torch::Tensor whole) {
  TORCH_CHECK(s.device().is_cpu() && theta.device().is_cpu() && whole.device().is_cpu(), "toptheta: a CPU kernel was handed tensors on another device; the backend registry must not choose it there");
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == torch::kFloat32 && s.is_contiguous(), "s: (R, K) float32 contiguous");
  TORCH_CHECK(theta.scalar_type() == torch::kFloat32 && theta.is_contiguous() && theta.numel() == s.size(0), "theta: (R) float32");
  TORCH_CHECK(whole.scalar_type() == torch::kBool && whole.is_contiguous() && whole.numel() == s.size(0), "whole: (R) bool");
  const int64_t R = s.size(0), K = s.size(1);
  auto kept_sum = torch::empty({R}, s.options());
  auto kept_count = torch::empty({R}, s.options().dtype(torch::kInt32));
  auto empty = torch::empty({R}, s.options().dtype(torch::kBool));
  float* S = s.data_ptr<float>();
  const float* T = theta.data_ptr<float>();
  const bool* W = whole.data_ptr<bool>();
  float* KS = kept_sum.data_ptr<float>();
  int32_t* KC = kept_count.data_ptr<int32_t>();
  bool* E = empty.data_ptr<bool>();
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = S + r * K;
      const float m = row_max(x, K);
      if (!(m > -std::numeric_limits<float>::infinity())) {
        KS[r] = 0.0f; KC[r] = 0; E[r] = false;
        continue;
      }
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
      KS[r] = ks; KC[r] = kc;
    }
  });
  return {kept_sum, kept_count, empty};
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

std::vector<torch::Tensor> post_topk(torch::Tensor s, int64_t k, torch::Tensor whole) {
  TORCH_CHECK(s.device().is_cpu() && whole.device().is_cpu(), "toptheta: a CPU kernel was handed tensors on another device; the backend registry must not choose it there");
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == torch::kFloat32 && s.is_contiguous(), "s: (R, K) float32 contiguous");
  TORCH_CHECK(whole.scalar_type() == torch::kBool && whole.is_contiguous() && whole.numel() == s.size(0), "whole: (R) bool");
  TORCH_CHECK(k >= 1, "k >= 1");
  const int64_t R = s.size(0), K = s.size(1);
  auto kept_sum = torch::empty({R}, s.options());
  auto kept_count = torch::empty({R}, s.options().dtype(torch::kInt32));
  float* S = s.data_ptr<float>();
  const bool* W = whole.data_ptr<bool>();
  float* KS = kept_sum.data_ptr<float>();
  int32_t* KC = kept_count.data_ptr<int32_t>();
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(K + 8);  // the selection's candidates, then the row's exp(s - m)
    for (int64_t r = r0; r < r1; ++r) {
      float* x = S + r * K;
      const float m = row_max(x, K);
      if (!(m > -std::numeric_limits<float>::infinity())) {
        KS[r] = 0.0f; KC[r] = 0;
        continue;
      }
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
          c = compact_above(x, K, sample[q], e.data());
        }
        if (c < k) {
          std::copy(x, x + K, e.begin());
          c = K;
        }
        std::nth_element(e.begin(), e.begin() + (k - 1), e.begin() + c, std::greater<float>());
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
      KS[r] = ks; KC[r] = kc;
    }
  });
  return {kept_sum, kept_count};
}
"""


def _target() -> tuple[str, list[str]]:
    """(name suffix, flags): AVX2 code where torch itself runs AVX2 or better, portable code otherwise. The name
    differs per target, so a cache shared by machines of different CPUs never hands one the other's build."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


# -ffast-math minus -ffinite-math-only (and minus -fcx-limited-range / -fexcess-precision, which do not apply here).
SAFE_FAST_MATH = ("-O3", "-fno-math-errno", "-funsafe-math-optimizations", "-fno-rounding-math", "-fno-signaling-nans")


def _openmp() -> list[str]:
    """-fopenmp where ATen parallelises with OpenMP (its parallel_for is a pragma in a header: without the flag the
    kernels run on one thread); the OpenMP runtime is then torch's own, already loaded, so torch.set_num_threads
    governs the kernels too. Other backends: vectorisation pragmas only."""
    return ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info().split("backend:")[-1] else ["-fopenmp-simd"]


BUILD_LOCK_TIMEOUT = 900.0  # seconds a build waits for another process's build of the same kernel


def build(name: str, source: str, functions: list[str], what: str, fallback: str):
    """Compile (once; cached per name and target) a C++ extension, or None where it cannot be built.

    Every toptheta kernel is built with the same flags: -ffast-math's parts except -ffinite-math-only (masked keys
    are -inf and rely on exp(-inf) = 0 and on comparisons with infinities). Reassociation
    (-funsafe-math-optimizations) stays: it lets the compiler vectorise the row reductions, which changes
    float summation order only (the tests compare the kernels with the plain path within float tolerance).

    Each kernel builds in its own directory under an OS file lock (``build_lock``): the lock dies with its process,
    so a job killed mid-build never leaves the next ones waiting on torch's own lock file (which, found while we hold
    ours, is stale and removed), and a build stuck elsewhere makes us wait BUILD_LOCK_TIMEOUT at most.
    """
    if os.environ.get("TOPTHETA_FUSED", "1") == "0":
        return None
    suffix, flags = _target()
    try:
        from torch.utils.cpp_extension import load_inline

        log.info("toptheta: loading %s (the first build takes about a minute, then it is cached)", what)
        directory = build_directory(f"{name}_{suffix}")
        with build_lock(directory / "toptheta.lock", BUILD_LOCK_TIMEOUT):
            stale = directory / "lock"  # torch's FileBaton: nobody holds it while we hold our lock
            if stale.exists():
                log.warning("toptheta: removing a stale build lock %s (a build that was killed)", stale)
                stale.unlink(missing_ok=True)
            return load_inline(name=f"{name}_{suffix}", cpp_sources=source,
                               functions=[*functions, "parallel_threads"],
                               extra_cflags=[*SAFE_FAST_MATH, *_openmp(), *flags], verbose=False,
                               build_directory=str(directory))
    except Exception as err:  # noqa: BLE001 (any build failure means: use the fallback)
        log.warning("toptheta: %s could not be built (%s); using %s", what,
                    str(err).splitlines()[0] if str(err) else type(err).__name__, fallback)
        return None


def build_directory(name: str):
    """``$TORCH_EXTENSIONS_DIR`` (else ``~/.cache/torch_extensions``)/toptheta/<name>, created."""
    from pathlib import Path

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(root).expanduser() if root else Path.home() / ".cache" / "torch_extensions"
    directory = root / "toptheta" / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def build_lock(path, timeout: float):
    """An exclusive ``flock`` on ``path`` (released by the OS when the holder dies), or TimeoutError after ``timeout``."""
    import fcntl
    import time

    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building in {path.parent} for over "
                                       f"{timeout:.0f} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def extension():
    """The compiled module, or None where it cannot be built (no compiler, TOPTHETA_FUSED=0)."""
    return build(f"toptheta_fused_v{_VERSION}", _SOURCE, ["post_threshold", "post_topk"], "the fused CPU kernel",
                 "the pure-torch path")


def enabled() -> bool:
    """Whether the fused kernel is available (builds it on the first call)."""
    return extension() is not None


def post_select(s: torch.Tensor, rule: FusedRule):
    """In place on ``s`` (B, H, Q, K): dense probabilities zeroed where ``rule`` does not keep them. Returns
    (kept_sum (B, H, Q, 1), kept_count (B, H, Q), empty (B, H, Q) bool: threshold rows where nothing passed θ and
    only the maximum was kept; None for top-k, which has no such rows), or None when the fused kernel is
    unavailable (``s`` is then untouched)."""
    ext = extension()
    if ext is None or s.device.type != "cpu" or not s.is_contiguous():
        return None
    B, H, Q, K = s.shape
    whole = rule.whole.expand(B, H, Q).contiguous().view(-1)
    if rule.k is not None:
        kept_sum, kept_count = ext.post_topk(s.view(-1, K), int(rule.k), whole)
        empty = None
    else:
        theta = rule.theta.expand(B, H, Q).float().contiguous()
        kept_sum, kept_count, empty = ext.post_threshold(s.view(-1, K), theta.view(-1), whole)
        empty = empty.view(B, H, Q)
    return kept_sum.view(B, H, Q, 1), kept_count.view(B, H, Q), empty
