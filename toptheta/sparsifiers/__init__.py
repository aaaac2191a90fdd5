"""Which elements of an attention row survive: dense, top-k, top-θ, the baselines top-p and skip-softmax, and top-ρ
(top-k with a budget proportional to the row)."""

from .base import FusedRule, RowBlock, Sparsifier
from .dense import Dense
from .skipsoftmax import SkipSoftmax
from .topk import TopK
from .topp import TopP
from .toprho import TopRho
from .toptheta import TopTheta

__all__ = ["Dense", "FusedRule", "RowBlock", "SkipSoftmax", "Sparsifier", "TopK", "TopP", "TopRho", "TopTheta"]
