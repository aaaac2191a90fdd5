"""How the dropped attention mass is put back: SDC and VMC."""

from .lowering import Compensation, KernelCompensation, is_compensation, lower
from .sdc import SDC
from .vmc import VMC

__all__ = ["SDC", "VMC", "Compensation", "KernelCompensation", "check_compensation", "is_compensation", "lower"]


def check_compensation(sparsifier, compensations) -> None:
    """Validate a sparsifier × compensation combination before any model work."""
    kinds = [type(c) for c in compensations]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"each compensation may appear once, got {compensations}")
    for c in compensations:
        if not is_compensation(c):
            raise TypeError(f"compensations must be compensation objects (SDC, VMC, or any object with check, lower "
                            f"and label: compensation/lowering.py), got {c!r}")
    if compensations and sparsifier.placement is None:
        raise ValueError("dense attention drops nothing, so compensation has nothing to put back; use comp=[]")
    for c in compensations:
        c.check(sparsifier, compensations)
