"""The sparse attention backend: kernel, transformers integration, statistics."""

from .backend import sparsify
from .kernel import sparse_attention
from .stats import SparsityStats

__all__ = ["SparsityStats", "sparse_attention", "sparsify"]
