"""An optional fused CPU kernel for threshold selection after the softmax (the Top-θ post-softmax hot path).

The pure-torch path makes five passes over a chunk's (Qc, Kc) scores between its two GEMMs: softmax,
row maximum, comparison, zeroing and row sum. Here one C++ loop does all of it row by row while the
row (≤ 32 kB for 8k keys) sits in L1: max, exp and sum, then p > cut, zeroing and the kept sum and
count. It is compiled on first use with torch's C++ extension tooling (g++; about a minute, cached in
``~/.cache/torch_extensions``); where that fails the kernel keeps the torch path and says so once.

Set ``TOPTHETA_FUSED=0`` to disable it (the torch path is the reference; tests compare the two).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("toptheta")
_VERSION = 5  # bump when _SOURCE or the flags change: the build cache is keyed by name

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
#include <cmath>
#include <limits>

""" + VECTOR_EXPF + PARALLEL_PROBE + r"""
// s: (R, K) float32 contiguous scaled logits, -inf where invalid. theta: (R) float32. whole: (R) bool.
// In place, each row becomes w = p * [p > cut] with p = softmax(row) and cut = min(theta, just below the
// row's largest p) (so the maximum is always kept); rows marked whole keep every p (invalid keys hold 0).
// Returns (kept_sum (R) float32: sum of w, kept_count (R) int32: kept keys of rows not marked whole,
// empty (R) bool: rows not marked whole where no p passes theta, i.e. only the maximum was kept).
std::vector<torch::Tensor> post_threshold(torch::Tensor s, torch::Tensor theta, torch::Tensor whole) {
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
      float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max:m)
      for (int64_t j = 0; j < K; ++j) m = x[j] > m ? x[j] : m;
      if (!(m > -std::numeric_limits<float>::infinity())) {  // no valid key (or NaN): weights 0
        for (int64_t j = 0; j < K; ++j) x[j] = 0.0f;
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


def build(name: str, source: str, functions: list[str], what: str, fallback: str):
    """Compile (once; cached by torch per name and target) a C++ extension, or None where it cannot be built.

    Every toptheta kernel is built with the same flags: -ffast-math's parts except -ffinite-math-only (masked keys
    are -inf and rely on exp(-inf) = 0 and on comparisons with infinities). Reassociation
    (-funsafe-math-optimizations) stays: it lets the compiler vectorise the row reductions, which changes
    float summation order only (the tests compare the kernels with the plain path within float tolerance).
    """
    if os.environ.get("TOPTHETA_FUSED", "1") == "0":
        return None
    suffix, flags = _target()
    try:
        from torch.utils.cpp_extension import load_inline

        log.info("toptheta: loading %s (the first build takes about a minute, then it is cached)", what)
        return load_inline(name=f"{name}_{suffix}", cpp_sources=source, functions=[*functions, "parallel_threads"],
                           extra_cflags=[*SAFE_FAST_MATH, *_openmp(), *flags], verbose=False)
    except Exception as err:  # noqa: BLE001 (any build failure means: use the fallback)
        log.warning("toptheta: %s could not be built (%s); using %s", what,
                    str(err).splitlines()[0] if str(err) else type(err).__name__, fallback)
        return None


@functools.cache
def extension():
    """The compiled module, or None where it cannot be built (no compiler, TOPTHETA_FUSED=0)."""
    return build(f"toptheta_fused_v{_VERSION}", _SOURCE, ["post_threshold"], "the fused CPU kernel",
                 "the pure-torch path")


def enabled() -> bool:
    """Whether the fused kernel is available (builds it on the first call)."""
    return extension() is not None


def post_threshold(s: torch.Tensor, theta: torch.Tensor, whole: torch.Tensor):
    """In place on ``s`` (B, H, Q, K): dense probabilities zeroed where not kept. Returns (kept_sum (B, H, Q, 1),
    kept_count (B, H, Q), empty (B, H, Q) bool: rows where nothing passed θ and only the maximum was kept), or None
    when the fused kernel is unavailable (``s`` is then untouched)."""
    ext = extension()
    if ext is None or s.device.type != "cpu" or not s.is_contiguous():
        return None
    B, H, Q, K = s.shape
    theta = theta.expand(B, H, Q).float().contiguous()
    whole = whole.expand(B, H, Q).contiguous()
    kept_sum, kept_count, empty = ext.post_threshold(s.view(-1, K), theta.view(-1), whole.view(-1))
    return kept_sum.view(B, H, Q, 1), kept_count.view(B, H, Q), empty.view(B, H, Q)
