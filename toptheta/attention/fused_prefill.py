"""The C++ one-pass prefill kernel behind ``prefill.py`` (flash-attention style, CPU, float32).

For each (sequence, KV head, block of queries) the G query heads are stacked as rows; key blocks stream by: one
GEMM gives the block's logits laid out keys × rows (our own micro-kernel, not BLAS: see ``gemm``), vector loops
across rows update each row's online softmax (running max m, dense sum l = Σ e^{s−m}), keep s > θ (the kept sum
R = Σ_kept e^{s−m}, kept count, the weights), and a second GEMM (or, where few weights are kept, a sparse loop
over the kept V rows) adds the kept weights times V to the rows' accumulators. A row that ends with nothing above
θ keeps its maximum (tracked on the side while nothing was kept). At the end each row is normalised with the
plain kernel's formulas: renormalised over the kept set, SDC's λ·E added to the denominator, VMC's β·v̄ added.
Post-softmax Top-θ and skip-softmax (which cuts at the row's final maximum) take two passes over the key blocks
(``prefill.py``).

A row's bits do not depend on its batch, padding, query block or neighbours (every per-row quantity is summed in
key order; key blocks start at the sequence's first valid key), so batched and shared-context scoring make
exactly the Top-θ decisions of scoring one request at a time.
Built on first use with torch's C++ extension tooling (cached in ``~/.cache/torch_extensions``); where that
fails, ``extension()`` returns None after one log line and the plain kernel runs.
"""

from __future__ import annotations

import functools
import logging

from .fused import build, kernel_source

log = logging.getLogger("toptheta")
_VERSION = 15  # bump when csrc/prefill.cpp, csrc/common.h or the flags change: the build cache is keyed by name


@functools.cache
def extension():
    """The compiled module, or None where it cannot be built (no compiler, TOPTHETA_FUSED=0)."""
    return build(f"toptheta_prefill_v{_VERSION}", kernel_source("prefill.cpp"), ["prefill"], "the one-pass prefill kernel",
                 "the plain kernel")
