"""Triton kernels (``toptheta.attention.triton``: prefill and decode wrappers) as a backend. [THE TRITON SEAM]

This file only lowers and forwards; the kernels and their wrappers live in ``toptheta/attention/triton/`` (written
separately). It registers a backend only when that package imports, and serves CUDA tensors, or CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``: how the tests run the very kernels a GPU compiles).

The wrappers take plain tensors, lowered here from the :class:`AttentionCall` (method.md §2-3):

    prefill(query (B, H, Q, D), key, value (B, Hkv, K, D) GQA unexpanded, *, key_start (B,) int32, lengths (B,) int32,
            q_offset int, window int | None, scaling float, theta (B, H, Q) float32 | None (None: dense),
            raw_theta (B, H, Q) float32 | None, placement "pre" | "post", sdc int (0 none, 1 exact, 2 exp-threshold,
            3 calibrated), sdc_scale float, sdc_mass (B, H, Q) float32 | None, vmc bool, empty_rows str)
        -> (out (B, Q, H, Dv), counters: dict of device tensors "kept_counts" (B, H, Q), "kept_mass" (B, H, Q),
            "empty" (B, H, Q) bool)
    decode(...same, Q == 1...) -> (out, counters + "vrow_counts" (B, Hkv))

Key j of sequence b is valid for query i when key_start[b] ≤ j < key_start[b] + lengths[b], j ≤ q_offset + i
(causal with left padding) and, with a window, j > q_offset + i − window. A mask of any other form, Top-k, observers,
soft-capping and biases stay with the other backends. A wrapper may export ``refuse(call) -> str | None`` to decline
more (shapes, dtypes); a wrapper that raises (a compile failure) is logged once and the plain kernel serves the call.
"""

from __future__ import annotations

import importlib
import logging
import os
import weakref

import torch

from ...sparsifiers.base import RowBlock
from .call import AttentionCall

log = logging.getLogger("toptheta")


def _kernels():
    """``toptheta.attention.triton``, or None where it (or Triton) is absent."""
    try:
        return importlib.import_module("toptheta.attention.triton")
    except ImportError:
        return None


class TritonBackend:
    name = "triton"
    priority = 50

    def __init__(self, module):
        self.module = module
        self.failed: set[str] = set()  # wrappers that raised once: not asked again in this process

    def refuse(self, call: AttentionCall) -> str | None:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if call.device.type != "cuda" and not (interpret and call.on_cpu):
            return f"CUDA tensors, or CPU tensors with TRITON_INTERPRET=1; got {call.device}"
        if call.kind not in ("dense", "toptheta"):
            return f"dense and Top-θ only, not {call.kind}"
        if call.observer is not None or call.softcap or call.bias is not None:
            return "no observers, soft-capping or additive biases"
        B, H, Hkv, Q, K = call.shape
        if K == 0 or (call.valid is None and K < Q):
            return "an empty cache, or a causal call with fewer keys than queries"
        which = "decode" if call.is_decode_row else "prefill"
        if which in self.failed:
            return f"its {which} kernel failed earlier in this process"
        if _segments(call) is None:
            return "the mask is not causal with left padding (one key range per sequence)"
        own = getattr(self.module, "refuse", None)
        return own(call) if own is not None else None

    def run(self, call: AttentionCall):
        which = "decode" if call.is_decode_row else "prefill"
        try:
            return self._run(call, which)
        except Exception as err:  # noqa: BLE001 (a compile failure or an unsupported shape: the plain kernel serves)
            self.failed.add(which)
            log.warning("toptheta: the Triton %s kernel failed (%s); using the plain kernel", which,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            from ..kernel import plain_attention

            return plain_attention(call)

    def _run(self, call: AttentionCall, which: str):
        B, H, Hkv, Q, K = call.shape
        key_start, lengths, q_offset = _segments(call)
        # row lengths n (B, 1, Q): the valid keys of each row, on the device
        pos = q_offset + torch.arange(Q, device=call.device)  # (Q,) query positions on the key axis
        n = (pos[None, :] + 1 - key_start[:, None]).clamp(min=0)
        n = torch.minimum(n, lengths[:, None]).view(B, 1, Q)
        theta = raw = mass = None
        rows = RowBlock(call.layer, call.phase, torch.zeros((), device=call.device).expand(B, H, Q, K), n)
        sparse = call.kind == "toptheta"
        if sparse:
            theta, raw, rows.clamped_rows = call.thetas(n, causal=call.valid is None)
            if call.sdc_mode == 3:
                mass = call.sdc_mass(n).expand(B, H, Q).contiguous()
        fn = getattr(self.module, which)
        out, counters = fn(call.query, call.key, call.value, key_start=key_start.int(), lengths=lengths.int(),
                           q_offset=q_offset, window=None, scaling=call.scaling, theta=theta, raw_theta=raw,
                           placement=call.placement, sdc=call.sdc_mode, sdc_scale=call.sdc_scale, sdc_mass=mass,
                           vmc=call.vmc, empty_rows=call.empty_rows)
        if call.counting:
            if sparse:
                rows.kept_counts = counters["kept_counts"].long().view(B, H, Q)
                rows.kept_mass = counters["kept_mass"].float().view(B, H, Q, 1)
                rows.empty = counters["empty"].bool().view(B, H, Q) & (n > call.sparsifier.k_for(call.layer))
                if "vrow_counts" in counters:
                    rows.vrow_counts = counters["vrow_counts"]
            call.stats.update(rows)
        return out if out.dtype == call.query.dtype else out.to(call.query.dtype)


def _segments(call: AttentionCall):
    """(key_start (B,), lengths (B,), q_offset) of a causal call with left padding, or None for another mask.

    A causal call (valid None) needs no mask. A mask is checked once per mask tensor (transformers hands every
    layer of a forward the same one): the only host read of a forward on this path.
    """
    B, H, Hkv, Q, K = call.shape
    device = call.device
    if call.valid is None:
        zeros = torch.zeros(B, dtype=torch.long, device=device)
        return zeros, torch.full((B,), K, dtype=torch.long, device=device), K - Q
    memo = _SEGMENTS.get(call.valid)
    if memo is not None and memo[0] == (B, Q, K):
        return memo[1]
    valid = call.valid.expand(B, 1, Q, K)[:, 0]  # (B, Q, K)
    last = valid[:, -1]  # (B, K): the last query sees every key of its sequence
    key_start = torch.where(last.any(-1), last.int().argmax(-1), torch.full((B,), K, device=device)).long()
    lengths = K - key_start
    q_offset = K - Q
    j = torch.arange(K, device=device)
    i = q_offset + torch.arange(Q, device=device)
    rebuilt = (j[None, None, :] >= key_start[:, None, None]) & (j[None, None, :] <= i[None, :, None])
    ok = bool(torch.equal(rebuilt, valid))
    result = (key_start, lengths, q_offset) if ok else None
    try:
        _SEGMENTS[call.valid] = ((B, Q, K), result)
    except TypeError:
        pass
    return result


_SEGMENTS: "weakref.WeakKeyDictionary[torch.Tensor, tuple]" = weakref.WeakKeyDictionary()

_MODULE = _kernels()
BACKEND = TritonBackend(_MODULE) if _MODULE is not None else None  # registered only where the kernels exist
