"""Dense attention on accelerators through ``torch.nn.functional.scaled_dot_product_attention`` (flash/efficient).

The dense baseline need not go through the chunked plain kernel on a GPU: sdpa computes the same softmax(q·k)·v
(rows with no valid key give 0, as the plain kernel), and the statistics need only each row's number of valid keys,
computed on the device from the mask (or from the shapes of a causal call). Chosen automatically off the CPU only,
so the CPU numbers stay the plain kernel's; ``TOPTHETA_BACKEND=sdpa`` forces it anywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...sparsifiers.base import RowBlock
from . import Backend
from .call import AttentionCall

_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")  # torch ≥ 2.5 (a builtin: no signature)


class Sdpa(Backend):
    name = "sdpa"
    priority = 10

    def refuse(self, call: AttentionCall) -> str | None:
        B, H, Hkv, Q, K = call.shape
        if call.on_cpu and not call.forced:
            return "chosen off the CPU only (on the CPU the plain kernel is the reference); force it to use it here"
        if call.kind != "dense" or call.compensations:
            return f"dense attention only, not {call.kind}"
        if call.observer is not None or call.softcap:
            return "no observers or soft-capping"
        if K == 0 or (call.valid is None and K < Q):
            return "an empty cache, or a causal call with fewer keys than queries"
        return None

    def run(self, call: AttentionCall):
        query, key, value, valid = call.query, call.key, call.value, call.valid
        B, H, Hkv, Q, K = call.shape
        dtype = query.dtype
        key, value = key.to(dtype), value.to(dtype)
        if valid is None:  # causal, the queries being the last Q keys (lower-right aligned)
            n = torch.arange(K - Q + 1, K + 1, device=query.device).expand(B, 1, Q)
            mask = None if Q == K else (torch.arange(K, device=query.device) < n[0, 0, :, None])[None, None]
        else:
            mask = valid.expand(B, 1, Q, K)
            n = mask.sum(-1)  # (B, 1, Q)
        attn_mask = mask
        if call.bias is not None:  # an additive bias: a float mask, -inf where invalid
            base = torch.zeros((), dtype=dtype, device=query.device)
            allowed = mask if mask is not None else torch.ones(Q, K, dtype=torch.bool, device=query.device).tril(K - Q)
            attn_mask = torch.where(allowed, base, float("-inf")) + call.bias.to(dtype)
        kwargs = {"enable_gqa": True} if _GQA and Hkv != H else {}
        if not kwargs and Hkv != H:
            key, value = key.repeat_interleave(H // Hkv, 1), value.repeat_interleave(H // Hkv, 1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                             is_causal=attn_mask is None and Q == K and valid is None,
                                             scale=call.scaling, **kwargs)  # (B, H, Q, Dv)
        if valid is not None:  # rows with no valid key: sdpa gives NaN, the plain kernel 0
            out = out.masked_fill((n == 0).view(B, 1, Q, 1), 0.0)
        if call.counting:
            shape = torch.zeros((), device=query.device).expand(B, H, Q, K)  # only the shape is read
            call.stats.update(RowBlock(call.layer, call.phase, shape, n))
        return out.transpose(1, 2).to(dtype)


BACKEND = Sdpa()
