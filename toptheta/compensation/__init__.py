"""How the dropped attention mass is put back: SDC and VMC."""

from .sdc import SDC
from .vmc import VMC

__all__ = ["SDC", "VMC"]


def check_compensation(sparsifier, compensations) -> None:
    """Validate a sparsifier × compensation combination before any model work."""
    kinds = [type(c) for c in compensations]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"each compensation may appear once, got {compensations}")
    for c in compensations:
        if not isinstance(c, (SDC, VMC)):
            raise TypeError(f"compensations must be SDC or VMC instances, got {c!r}")
    if compensations and sparsifier.placement is None:
        raise ValueError("dense attention drops nothing, so compensation has nothing to put back; use comp=[]")
    for c in compensations:
        if isinstance(c, SDC):
            c.check(sparsifier)
        else:
            c.check(sparsifier, compensations)
