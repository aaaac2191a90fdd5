"""Which elements of an attention row survive: dense, top-k, top-θ."""

from .base import FusedRule, RowBlock, Sparsifier
from .dense import Dense
from .topk import TopK
from .toptheta import TopTheta

__all__ = ["Dense", "FusedRule", "RowBlock", "Sparsifier", "TopK", "TopTheta"]
