"""Dense attention through our backend: the baseline, and the reference for equivalence tests."""

from __future__ import annotations

from ..registry import SPARSIFIERS
from .base import RowBlock, Sparsifier


@SPARSIFIERS.register("dense")
class Dense(Sparsifier):
    """Keeps every valid key. With no compensation it equals transformers' eager/sdpa attention."""

    label = "dense"
    parameter = None

    @classmethod
    def from_settings(cls, settings: dict, thresholds=None) -> "Dense":
        return cls()

    def select(self, rows: RowBlock) -> None:
        return None

    def __repr__(self) -> str:
        return "Dense()"
