"""VMC, V-mean compensation (method.md §3.2).

The probability mass β missing from a row after selection is given to the mean V row:
o_i ← o_i + β_i · v̄_i, where v̄_i is the mean of the V rows over the row's valid keys (kept and
dropped alike, per KV head). With exact SDC (or post-softmax selection) β is exactly the dropped
probability, so every dropped V row is replaced by the mean V row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..registry import register_compensation
from .lowering import KernelCompensation, lower


@register_compensation("vmc", label="VMC")
@dataclass
class VMC:
    """V-mean compensation. It has no parameters: β comes from the kernel's float32 weights."""

    label = "VMC"

    @classmethod
    def from_config(cls, comp: dict, thresholds=None) -> "VMC | None":
        return cls() if comp.get("vmc") else None

    def lower(self, into: KernelCompensation, placement: str | None) -> KernelCompensation:
        return replace(into, vmc=placement is not None)

    def check(self, sparsifier, compensations) -> None:
        """Pre-softmax without SDC renormalises each row, so β is always 0: refuse it."""
        if sparsifier.placement == "pre" and lower(compensations, "pre").sdc is None:
            raise ValueError(
                "VMC with pre-softmax selection and no SDC does nothing (rows are renormalised, so the "
                "missing mass β is always 0); add SDC('exact') or use placement='post'"
            )
