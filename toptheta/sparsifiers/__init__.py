"""Which elements of an attention row survive: dense, top-k, top-θ."""

from .base import RowBlock, Sparsifier
from .dense import Dense
from .topk import TopK
from .toptheta import TopTheta

__all__ = ["Dense", "RowBlock", "Sparsifier", "TopK", "TopTheta"]
