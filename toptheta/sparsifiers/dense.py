"""Dense attention through our backend: the baseline, and the reference for equivalence tests."""

from __future__ import annotations

from .base import RowBlock, Sparsifier


class Dense(Sparsifier):
    """Keeps every valid key. With no compensation it equals transformers' eager/sdpa attention."""

    def select(self, rows: RowBlock) -> None:
        return None

    def __repr__(self) -> str:
        return "Dense()"
