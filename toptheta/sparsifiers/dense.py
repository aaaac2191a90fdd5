"""Dense attention through our backend: the baseline, and the reference for equivalence tests."""

from __future__ import annotations

from ..registry import register_sparsifier
from .base import RowBlock, Sparsifier


@register_sparsifier("dense", label="Dense", placements=())
class Dense(Sparsifier):
    """Keeps every valid key. With no compensation it equals transformers' eager/sdpa attention."""

    @classmethod
    def from_config(cls, settings: dict, thresholds=None) -> "Dense":
        return cls()

    def select(self, rows: RowBlock) -> None:
        return None

    def __repr__(self) -> str:
        return "Dense()"
