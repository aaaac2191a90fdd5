"""Which elements of an attention row survive: dense, top-k, top-θ, and the baselines top-p and skip-softmax."""

from .base import FusedRule, RowBlock, Sparsifier
from .dense import Dense
from .skipsoftmax import SkipSoftmax
from .topk import TopK
from .topp import TopP
from .toptheta import TopTheta

__all__ = ["Dense", "FusedRule", "RowBlock", "SkipSoftmax", "Sparsifier", "TopK", "TopP", "TopTheta"]
