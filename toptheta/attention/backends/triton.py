"""Triton kernels (``toptheta.attention.triton``) as a backend. [THE TRITON SEAM]

This file only lowers and forwards; the kernels and their wrappers live in ``toptheta/attention/triton/``
(``prefill_attention``, ``decode_attention``: plain tensors in, a ``TritonAttention`` of device tensors out). It
registers a backend only where that package imports and says Triton is ``available()``. It serves CUDA tensors,
and CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``) when forced with ``TOPTHETA_BACKEND=triton``
(how tests run the very kernels a GPU compiles; never chosen on its own on a CPU, where the C++ kernels serve).

Lowering (the rest comes from :class:`AttentionCall`, as for every backend): the mask becomes one key range per
sequence, ``key_start`` (left padding) to K, with the queries at ``q_offset = K − Q`` (causal); a mask of another
form (a sliding window, a bidirectional or hand-made one) goes to the other backends. θ per row is
``call.thetas`` (rows kept whole get a θ that keeps every key), skip-softmax's ln(λ/n) per row
``SkipSoftmax.cut_offsets`` (the kernels cut at min(m + it, m) with the row's maximum), calibrated SDC's mass
``call.sdc_mass``; in decode steps, Top-k's and top-p's boundary rules (``lowering.row_boundary``: the decode kernel
ranks the logits it writes between its launches). Their prefill is left to the plain kernel: a boundary is a
selection over the whole row, which a prefill tile never holds. The
kernels add each call's statistics to the layer's packed counters themselves (``SparsityStats.packed_row``).
A kernel that raises (a compile failure) is logged once and the plain kernel serves that call and later ones.
"""

from __future__ import annotations

import importlib
import logging
import os
import weakref

import torch

from .. import decode
from ..kernel import plain_attention
from ..triton.common import stats_target
from ..triton.lowering import row_boundary
from . import Backend
from .call import AttentionCall

log = logging.getLogger("toptheta")


def _kernels():
    """``toptheta.attention.triton`` where it and Triton import, else None."""
    try:
        module = importlib.import_module("toptheta.attention.triton")
    except ImportError:
        return None
    available = getattr(module, "available", None)
    return module if available is None or available() else None


class TritonBackend(Backend):
    name = "triton"
    priority = 50

    def __init__(self, module):
        self.module = module
        self.failed: set[str] = set()  # kernels that raised once: not asked again in this process

    def refuse_device(self, call: AttentionCall) -> str | None:
        """Why the call's tensors are not the kernels' (the first of ``refuse``'s checks), or None."""
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if call.device.type != "cuda" and not (call.on_cpu and interpret and call.forced):
            return (f"CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 and TOPTHETA_BACKEND=triton); got "
                    f"{call.device}")
        return None

    def refuse(self, call: AttentionCall) -> str | None:
        device = self.refuse_device(call)
        if device is not None:
            return device
        if call.kind not in SERVED and not (call.kind in RANKED and _which(call) == "decode"):
            return (f"dense, Top-θ and skip-softmax, and Top-k and top-p in decode steps only, not {call.kind} in "
                    f"{_which(call)} (a prefill row's k-th logit or nucleus is a selection over the whole row, which "
                    "no prefill tile holds: the plain kernel's topk and sort serve them)")
        if call.observer is not None or call.softcap or call.bias is not None:
            return "no observers, soft-capping or additive biases"
        if torch.is_grad_enabled() and any(t.requires_grad for t in (call.query, call.key, call.value)):
            return "inference only (the kernels have no backward): run under torch.no_grad() or inference_mode()"
        B, H, Hkv, Q, K = call.shape
        if K == 0 or (call.valid is None and K < Q):
            return "an empty cache, or a causal call with fewer keys than queries"
        which = _which(call)
        if which in self.failed:
            return f"its {which} kernel failed earlier in this process"
        if _segments(call) is None:
            return "the mask is not causal with left padding (one key range per sequence)"
        return None

    def run(self, call: AttentionCall):
        which = _which(call)
        try:
            return self._run(call, which)
        except Exception as err:  # noqa: BLE001 (a compile failure or an unsupported shape: the plain kernel serves)
            if not isinstance(err, ValueError):  # a shape the wrapper refuses is not a broken kernel
                self.failed.add(which)
            log.warning("toptheta: the Triton %s kernel cannot run this call (%s); using the plain kernel", which,
                        str(err).splitlines()[0] if str(err) else type(err).__name__)
            return plain_attention(call)

    def _run(self, call: AttentionCall, which: str):
        B, H, Hkv, Q, K = call.shape
        key_start, q_offset = _segments(call)
        # valid keys of each row (B, 1, Q): [key_start, position] with the queries at q_offset .. q_offset + Q − 1
        pos = q_offset + torch.arange(Q, device=call.device)
        n = (pos[None, :] + 1 - key_start[:, None]).clamp(min=0).view(B, 1, Q)
        sparse = call.kind != "dense"
        theta = mass = offsets = None
        clamped = 0
        if call.kind == "toptheta":
            theta, _, clamped = call.thetas(n, causal=call.valid is None)
        elif call.kind == "skipsoftmax":  # one λ: ln(λ/n) per row, the kernels cut at min(m + it, m)
            offsets = call.sparsifier.cut_offsets(call.layer, n)
        if sparse and call.sdc_mode == 3:
            mass = call.sdc_mass(n)
        kernel = self.module.decode_attention if which == "decode" else self.module.prefill_attention
        further = {}  # the kernel's arguments beyond the common ones
        if call.counting:  # the kernel adds the call's statistics to the layer's counters itself: no tensor ops here
            row, columns = stats_target(call.stats, call.layer, call.phase, call.device)
            further.update(stats_row=row, stats_columns=columns)
        if call.kind in RANKED:  # decode only: the boundary is found between the kernel's launches
            further["boundary"] = row_boundary(call.sparsifier, call.layer)
        if which == "decode" and sparse and call.vmc and Q == 1:
            further["v_sum"] = running_value_sum(call.layer, call.value, key_start)
        result = kernel(call.query, call.key, call.value, scaling=call.scaling, theta=theta,
                        placement=call.placement if sparse else None, key_start=key_start, key_end=K,
                        q_offset=q_offset, causal=True, window=None, sdc=call.sdc.estimator if call.sdc else None,
                        sdc_scale=call.sdc_scale if call.sdc else 1.0, sdc_mass=mass, vmc=call.vmc,
                        empty_rows=call.empty_rows, cut_offset=offsets, **further)
        if call.counting and sparse:
            call.stats.count_clamped(clamped, call.device)
        out = result.out.transpose(1, 2)  # (B, Q, H, Dv)
        return out if out.dtype == call.query.dtype else out.to(call.query.dtype)


SERVED = ("dense", "toptheta", "skipsoftmax")  # registered sparsifier names the kernels compute
RANKED = ("topk", "topp")  # ... and those they compute in decode steps, ranking whole rows of the logits they write


def running_value_sum(layer: int, value: torch.Tensor, key_start: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, Dv) float64 Σ V over each sequence's keys [key_start, K) for VMC's v̄ in a decode step, without
    reading all of V each step (which would cost what the kept V rows save) and without a host read.

    The sum is kept per layer in ``decode._VSUMS`` (cleared when a ``generate`` call starts) with the tensor that
    owns V's memory (a weak reference) and the length summed: a cache that grows in place (``cache.GrowingLayer``,
    whose V is a view of one buffer) adds only its new rows; another tensor (a cache that reallocates, grows its
    buffer, or was cropped or reordered) is summed whole once. Rows before the length seen last are taken to be
    unchanged while the owner is the same: true of appends within one generation, the only place decode steps
    come from.
    """
    B, Hkv, K, Dv = value.shape
    slot = ("triton", layer, B, Hkv, Dv, value.dtype, value.device)
    owner = value if value._base is None else value._base
    where = (value.storage_offset(), value.stride())
    state = decode._VSUMS.get(slot)
    if state is not None and state[0]() is owner and state[1] == where and state[2] <= K:
        upto, total = state[2], state[3]
    else:
        upto, total = 0, torch.zeros(B, Hkv, Dv, dtype=torch.float64, device=value.device)
    if upto < K:
        keys = torch.arange(upto, K, device=value.device)
        rows = value[:, :, upto:] * (keys[None, :] >= key_start[:, None]).to(value.dtype)[:, None, :, None]
        total = total + rows.sum(2, dtype=torch.float64)
    decode._VSUMS[slot] = (weakref.ref(owner), where, K, total)
    return total


def _which(call: AttentionCall) -> str:
    """Decode steps (their V-row statistics need the group's union) go to the decode kernel, the rest to prefill."""
    return "decode" if call.phase == "decode" else "prefill"


def _segments(call: AttentionCall):
    """(key_start (B,) int32, q_offset) of a causal call with left padding, or None for a mask of another form.

    A causal call (valid None) needs no mask. A mask is checked once per mask tensor (transformers hands every layer
    of a forward the same one): the only host read of a forward on this path.
    """
    B, H, Hkv, Q, K = call.shape
    device = call.device
    if call.valid is None:
        return torch.zeros(B, dtype=torch.int32, device=device), K - Q
    memo = _SEGMENTS.get(id(call.valid))
    if memo is not None and memo[0]() is call.valid and memo[1] == (B, Q, K):
        return memo[2]
    valid = call.valid.expand(B, 1, Q, K)[:, 0]  # (B, Q, K)
    last = valid[:, -1]  # (B, K): the last query sees every key of its sequence
    key_start = torch.where(last.any(-1), last.int().argmax(-1), K).int()
    j = torch.arange(K, device=device)
    position = (K - Q) + torch.arange(Q, device=device)
    rebuilt = (j >= key_start[:, None, None]) & (j <= position[None, :, None])  # (B, Q, K)
    result = (key_start, K - Q) if bool(torch.equal(rebuilt, valid)) else None
    if len(_SEGMENTS) > 64:  # masks of forwards gone by
        _SEGMENTS.clear()
    _SEGMENTS[id(call.valid)] = (weakref.ref(call.valid), (B, Q, K), result)
    return result


# id(mask) -> (weak reference to it, (B, Q, K), segments). Keyed by id: a tensor's == is elementwise.
_SEGMENTS: dict[int, tuple] = {}

_MODULE = _kernels()
BACKEND = TritonBackend(_MODULE) if _MODULE is not None else None  # registered only where the kernels exist
