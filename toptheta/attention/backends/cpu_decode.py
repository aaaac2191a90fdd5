"""The C++ decode kernel (``decode.py`` / ``fused_decode.py``): dense and Top-θ decode steps over a float32 CPU cache.

K read once, V rows read only where a head of the group keeps them, VMC from the running V sum beside the cache.
"""

from __future__ import annotations

import torch

from .. import decode, fused_decode
from . import Backend
from .call import AttentionCall


class CpuDecode(Backend):
    name = "cpu-decode"
    priority = 40

    def refuse(self, call: AttentionCall) -> str | None:
        B, H, Hkv, Q, K = call.shape
        if not call.on_cpu:
            return f"a CPU kernel, and the tensors are on {call.device}"
        if not decode.ENABLED:
            return "the fast paths are off (TOPTHETA_FAST=0 or decode.ENABLED = False)"
        if not call.is_decode_row:
            return "decode steps (one query row, phase 'decode') only"
        if call.kind not in ("dense", "toptheta"):
            return f"dense and Top-θ only, not {call.kind}"
        if call.empty_rows != "keep-max":
            return f"empty_rows={call.empty_rows!r}: the kernel keeps each row's maximum (keep-max) only"
        if call.observer is not None or call.softcap or call.bias is not None:
            return "no observers, soft-capping or additive biases"
        if K == 0:
            return "an empty cache"
        if call.key.dtype != torch.float32 or call.value.dtype != torch.float32:
            return f"a float32 cache only, not {call.key.dtype}"
        if call.key.stride(-1) != 1 or call.value.stride(-1) != 1:
            return "K and V need unit stride in the head dimension"
        if fused_decode.extension() is None:
            return "the decode kernel could not be built (no C++ compiler, or TOPTHETA_FUSED=0)"
        return None

    def run(self, call: AttentionCall):
        return decode.attention(call.query, call.key, call.value, call.valid, scaling=call.scaling, layer=call.layer,
                                sparsifier=call.sparsifier, compensations=call.compensations, stats=call.stats)


BACKEND = CpuDecode()
