"""Sparse decode in torch ops (``decode.py``): V read only at the kept rows, VMC from a running V sum; CPU.

Top-k decoding, observers, soft-capping, biases and bfloat16/float16 caches. Not on accelerators: choosing the
gathered rows reads their counts on the host (there the plain kernel serves decode steps without a host read).
"""

from __future__ import annotations

from .. import decode
from . import Backend
from .call import AttentionCall


class TorchDecode(Backend):
    name = "torch-decode"
    priority = 35

    def refuse(self, call: AttentionCall) -> str | None:
        B, H, Hkv, Q, K = call.shape
        if not call.on_cpu:
            return f"CPU only (it reads row counts on the host), and the tensors are on {call.device}"
        if not decode.ENABLED:
            return "the fast paths are off (TOPTHETA_FAST=0 or decode.ENABLED = False)"
        if not call.is_decode_row:
            return "decode steps (one query row, phase 'decode') only"
        if call.empty_rows != "keep-max":
            return f"empty_rows={call.empty_rows!r}: the plain kernel implements the reference rule"
        if K == 0:
            return "an empty cache"
        return None

    def run(self, call: AttentionCall):
        return decode.attention(call.query, call.key, call.value, call.valid, scaling=call.scaling, layer=call.layer,
                                sparsifier=call.sparsifier, compensations=call.compensations, stats=call.stats,
                                observer=call.observer, softcap=call.softcap, bias=call.bias, fused=False)


BACKEND = TorchDecode()
