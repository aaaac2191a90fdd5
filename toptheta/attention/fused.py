"""An optional fused CPU kernel for selection after the softmax (Top-θ, Top-k, top-p and skip-softmax post-softmax).

The pure-torch path makes five passes over a chunk's (Qc, Kc) scores between its two GEMMs: softmax,
row maximum, comparison, zeroing and row sum. Here one C++ loop does all of it row by row while the
row (≤ 32 kB for 8k keys) sits in L1: max, exp and sum, then p > cut, zeroing and the kept sum and
count. Top-k first finds each row's k-th largest logit: the keys above a pivot placed by a strided sample of the
row (about 4k of them; an AVX2 compaction copies them out) go through ``std::nth_element``, the whole row only where
fewer than k pass; then it keeps the logits above that value, as the torch path (``torch.topk``) keeps the k largest.
Top-p finds each row's nucleus boundary by a three-way selection on the logits with the masses in double (expected
O(K), where the torch path sorts the row); skip-softmax's cut is computed by the sparsifier and compared here.
It is compiled on first use with torch's C++ extension tooling (g++; about a minute, cached in
``~/.cache/torch_extensions``); where that fails the kernel keeps the torch path and says so once.

Set ``TOPTHETA_FUSED=0`` to disable it (the torch path is the reference; tests compare the two).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from pathlib import Path

import torch

from ..sparsifiers.base import FusedRule

log = logging.getLogger("toptheta")
_VERSION = 13  # bump when csrc/select.cpp, csrc/common.h or the flags change: the build cache is keyed by name
CSRC = Path(__file__).with_name("csrc")  # the C++ sources of the CPU kernels, one file per kernel + common.h


def kernel_source(filename: str) -> str:
    """The C++ source of ``csrc/<filename>`` with ``csrc/common.h`` spliced in place of its ``#include "common.h"``.

    Spliced rather than included: torch's extension builder hashes only the source text it is given, so a change of
    the header must change that text to trigger a rebuild."""
    source = (CSRC / filename).read_text()
    include = '#include "common.h"'
    if source.count(include) != 1:
        raise RuntimeError(f"{CSRC / filename} must include common.h exactly once")
    return source.replace(include, (CSRC / "common.h").read_text())


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
        from torch.utils.cpp_extension import load_inline  # heavy (torch's build tools): only when a kernel builds

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
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(root).expanduser() if root else Path.home() / ".cache" / "torch_extensions"
    directory = root / "toptheta" / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def build_lock(path, timeout: float):
    """An exclusive ``flock`` on ``path`` (released by the OS when the holder dies), or TimeoutError after ``timeout``."""
    import fcntl  # POSIX only: elsewhere a build fails into the fallback, and `import toptheta` still works

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
    return build(f"toptheta_fused_v{_VERSION}", kernel_source("select.cpp"),
                 ["post_threshold", "post_topk", "post_topp", "post_cut"], "the fused CPU kernel", "the pure-torch path")


def enabled() -> bool:
    """Whether the fused kernel is available (builds it on the first call)."""
    return extension() is not None


def post_select(s: torch.Tensor, rule: FusedRule):
    """In place on ``s`` (B, H, Q, K): dense probabilities zeroed where ``rule`` does not keep them. Returns
    (kept_sum (B, H, Q, 1), kept_count (B, H, Q), empty (B, H, Q) bool: threshold rows where nothing passed θ and
    only the maximum was kept; None for top-k and top-p, which have no such rows; the rule's own for a cut), or None
    when the fused kernel is unavailable (``s`` is then untouched)."""
    ext = extension()
    if ext is None or s.device.type != "cpu" or not s.is_contiguous():
        return None
    B, H, Q, K = s.shape
    whole = rule.whole.expand(B, H, Q).contiguous().view(-1)
    if rule.k is not None:
        kept_sum, kept_count = ext.post_topk(s.view(-1, K), int(rule.k), whole)
        empty = None
    elif rule.p is not None:
        kept_sum, kept_count = ext.post_topp(s.view(-1, K), float(rule.p), whole)
        empty = None
    elif rule.cut is not None:
        cut = rule.cut.expand(B, H, Q).float().contiguous()
        kept_sum, kept_count = ext.post_cut(s.view(-1, K), cut.view(-1), whole)
        empty = rule.empty
    else:
        theta = rule.theta.expand(B, H, Q).float().contiguous()
        kept_sum, kept_count, empty = ext.post_threshold(s.view(-1, K), theta.view(-1), whole)
        empty = empty.view(B, H, Q)
    return kept_sum.view(B, H, Q, 1), kept_count.view(B, H, Q), empty
