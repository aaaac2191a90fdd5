"""The plain torch kernel (``kernel.plain_attention``): every call, any device. The reference the others match."""

from __future__ import annotations

from ..kernel import plain_attention
from . import Backend
from .call import AttentionCall


class Plain(Backend):
    name = "plain"
    priority = 0

    def refuse(self, call: AttentionCall) -> str | None:
        return None

    def run(self, call: AttentionCall):
        return plain_attention(call)


BACKEND = Plain()
