"""The C++ one-pass prefill (``prefill.py`` / ``fused_prefill.py``): dense, Top-θ and skip-softmax prefill on CPU,
float32 inside."""

from __future__ import annotations

from .. import fused_prefill, prefill
from . import Backend
from .call import AttentionCall


class CpuPrefill(Backend):
    name = "cpu-prefill"
    priority = 30

    def refuse(self, call: AttentionCall) -> str | None:
        B, H, Hkv, Q, K = call.shape
        if not call.on_cpu:
            return f"a CPU kernel, and the tensors are on {call.device}"
        if not prefill.ENABLED:
            return "the fast paths are off (TOPTHETA_FAST=0 or prefill.ENABLED = False)"
        if call.is_decode_row:
            return "decode steps go to the decode backends"
        if call.kind not in ("dense", "toptheta", "skipsoftmax"):
            return f"dense, Top-θ and skip-softmax only, not {call.kind}"
        if call.kind != "dense" and call.phase != "prefill":
            return "Top-θ and skip-softmax in prefill only (decode statistics need the keep mask)"
        if call.kind == "skipsoftmax" and call.sdc_mode not in (0, 1):
            return "skip-softmax with SDC exact or none (the other estimators need a calibrated θ)"
        if call.empty_rows != "keep-max":
            return f"empty_rows={call.empty_rows!r}: the kernel keeps each row's maximum (keep-max) only"
        if call.observer is not None or call.softcap or call.bias is not None:
            return "no observers, soft-capping or additive biases"
        if (call.valid is None and K < Q) or K == 0:
            return "a causal call needs at least as many keys as queries"
        if fused_prefill.extension() is None:
            return "the one-pass prefill kernel could not be built (no C++ compiler, or TOPTHETA_FUSED=0)"
        return None

    def run(self, call: AttentionCall):
        out = prefill.attention(call.query, call.key, call.value, call.valid, scaling=call.scaling, layer=call.layer,
                                sparsifier=call.sparsifier, compensations=call.compensations, stats=call.stats,
                                phase=call.phase)
        if out is None:  # refuse() checks what attention() checks: this would be a bug in one of them
            raise RuntimeError("cpu-prefill accepted a call its kernel does not serve")
        return out


BACKEND = CpuPrefill()
