"""VMC, V-mean compensation (method.md §3.2).

The probability mass β missing from a row after selection is given to the mean V row:
o_i ← o_i + β_i · v̄_i, where v̄_i is the mean of the V rows over the row's valid keys (kept and
dropped alike, per KV head). With exact SDC (or post-softmax selection) β is exactly the dropped
probability, so every dropped V row is replaced by the mean V row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VMC:
    """V-mean compensation. It has no parameters: β comes from the kernel's float32 weights."""

    def check(self, sparsifier, compensations) -> None:
        """Pre-softmax without SDC renormalises each row, so β is always 0: refuse it."""
        from .sdc import SDC

        if sparsifier.placement == "pre" and not any(isinstance(c, SDC) for c in compensations):
            raise ValueError(
                "VMC with pre-softmax selection and no SDC does nothing (rows are renormalised, so the "
                "missing mass β is always 0); add SDC('exact') or use placement='post'"
            )
