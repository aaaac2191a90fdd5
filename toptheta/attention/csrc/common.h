// Shared by every toptheta CPU kernel. Not compiled on its own: the Python loader (fused.kernel_source) splices this
// file in place of each kernel's `#include "common.h"` line, so the source torch hashes for its build cache changes
// whenever this header does.

// Kernels are built without -ffinite-math-only (see fused.build): masked keys hold -inf and rely on exp(-inf) = 0
// and IEEE comparisons. GCC still vectorises expf through glibc's libmvec when told the vector variants exist (glibc
// declares them only under __FAST_MATH__); libmvec handles -inf and the other special inputs exactly like scalar expf.
#if defined(__x86_64__) && defined(__GLIBC__)
extern "C" float expf(float) noexcept __attribute__((__simd__("notinbranch")));
#endif

// Every kernel exports this probe: how many threads its at::parallel_for really uses. ATen's OpenMP backend runs
// parallel_for through `#pragma omp parallel` in a header, so an extension built without -fopenmp runs every task
// on the calling thread, silently (both kernels did until this probe's test existed).
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
