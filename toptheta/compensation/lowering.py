"""What a call's compensations ask of an attention kernel, said once by each compensation (method.md §3).

Every backend reads a :class:`KernelCompensation`: the SDC estimate to add to a pre-softmax denominator (or None) and
whether VMC adds β·v̄. A compensation contributes through its ``lower(into, placement)`` method, so kernels never
switch on its type: a new compensation that reuses these inputs is one file; one that needs a new kernel input adds a
field here and the backends that can serve it (the others refuse the call, and the plain kernel serves it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


SDC_MODES = {None: 0, "exact": 1, "exp-threshold": 2, "calibrated": 3}  # the compiled kernels' SDC argument


@dataclass(frozen=True)
class KernelCompensation:
    """The kernel inputs of a call's compensations."""

    sdc: Any = None  # an SDC: the dropped mass λ·E its estimator adds to a pre-softmax row's denominator
    vmc: bool = False  # add β·v̄ (β: the row's missing probability mass, v̄: the mean V row over its valid keys)

    @property
    def sdc_mode(self) -> int:
        """The compiled kernels' SDC argument: 0 none, 1 exact, 2 exp-threshold, 3 calibrated."""
        return SDC_MODES[self.sdc.estimator if self.sdc is not None else None]

    @property
    def sdc_scale(self) -> float:
        """λ (0.0 without SDC)."""
        return float(self.sdc.scale) if self.sdc is not None else 0.0

    def calibrated_mass(self, layer: int, n, sparsifier):
        """Calibrated SDC's dropped mass for rows of lengths n (B, 1, Q): (B, H|1, Q) float32; None for other modes.
        Read from the SDC's own thresholds, else the sparsifier's (Top-θ)."""
        if self.sdc_mode != SDC_MODES["calibrated"]:
            return None
        source = self.sdc.thresholds or sparsifier.thresholds
        return source.lookup_sdc(layer, n).float()


class Compensation(Protocol):
    """What every compensation provides: a check against its sparsifier, its kernel inputs, a stable label."""

    def check(self, sparsifier, compensations: Sequence) -> None: ...

    def lower(self, into: KernelCompensation, placement: str | None) -> KernelCompensation: ...

    @property
    def label(self) -> str: ...


def is_compensation(obj) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("check", "lower")) and hasattr(obj, "label")


def lower(compensations: Sequence, placement: str | None) -> KernelCompensation:
    """The kernel inputs of ``compensations`` for a selection at ``placement`` (None: dense, nothing to put back)."""
    out = KernelCompensation()
    for c in compensations:
        out = c.lower(out, placement)
    return out
