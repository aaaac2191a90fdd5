"""The C++ decode kernel behind ``decode.py``: one query row per sequence over a KV cache, in two passes.

Tasks are (sequence, KV head, block of keys), so a single sequence with few KV heads still fills the threads.
Pass 1 reads each K row once and computes the G query heads' logits from it, four keys at a time (stored, B·H·K
floats), each block's maximum, Σ e^{s−max} and, for pre-softmax θ, how many logits pass θ. The blocks are merged
per row into m and l. Pass 2 decides per key and head, as the plain kernel does: pre-softmax keep s > θ (a row
where nothing passed keeps its maximum), post-softmax keep p = e^{s−m}/l > θ and the maximum; and reads a V row
only when one of the G heads keeps it (the union of the heads' keep flags, compacted, the rows prefetched ahead),
accumulating e^{s−m}·v per head. The rows are finished with the plain kernel's formulas (renormalised over the kept
set + SDC for pre, dense probabilities for post, β·v̄ for VMC). The kernel reports per row the kept count, the kept
dense mass, whether it was empty, and per (sequence, KV head) the number of V rows read (the union over its heads):
the statistics the plain kernel derives from its keep mask; given a layer's packed counter row
(``SparsityStats.decode_row``) it adds them there itself, as ``SparsityStats.update`` would. Source:
``csrc/decode.cpp``. Built on first use like the other kernels (``fused.build``); None where it cannot be built.
"""

from __future__ import annotations

import functools

from .fused import build, kernel_source

_VERSION = 5  # bump when csrc/decode.cpp, csrc/common.h or the flags change: the build cache is keyed by name


@functools.cache
def extension():
    """The compiled module, or None where it cannot be built (no compiler, TOPTHETA_FUSED=0)."""
    return build(f"toptheta_decode_v{_VERSION}", kernel_source("decode.cpp"), ["decode"], "the decode kernel",
                 "the torch decode path")
