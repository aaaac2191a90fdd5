"""The plain kernel with its post-softmax selection in C++ (``fused.py``): Top-θ, Top-k, top-p and skip-softmax
post-softmax prefill on CPU.

Softmax, threshold (or the k-th largest logit), zeroing and the kept sums in one pass per row; the GEMMs, VMC and
the statistics stay the plain kernel's. A chunk whose rule the sparsifier does not offer (e.g. Top-k on rows that
all fit in k) runs the torch ops inside the same call.
"""

from __future__ import annotations

from ...sparsifiers.base import Sparsifier
from .. import fused
from ..kernel import plain_attention
from . import Backend
from .call import AttentionCall


class CpuSelect(Backend):
    name = "cpu-select"
    priority = 20

    def refuse(self, call: AttentionCall) -> str | None:
        if not call.on_cpu:
            return f"a CPU kernel, and the tensors are on {call.device}"
        if call.placement != "post":
            return "it selects after the softmax (placement='post') only"
        if type(call.sparsifier).fused_rule is Sparsifier.fused_rule:
            return f"{type(call.sparsifier).__name__} offers no rule the kernel applies (fused_rule)"
        if call.phase != "prefill":
            return "prefill only (decode statistics need the keep mask itself)"
        if call.observer is not None:
            return "observers (calibration) read every view of the rows: the plain kernel serves them"
        if fused.extension() is None:
            return "the fused CPU kernel could not be built (no C++ compiler, or TOPTHETA_FUSED=0)"
        return None

    def run(self, call: AttentionCall):
        return plain_attention(call, fuse=True)


BACKEND = CpuSelect()
