"""The sparse attention backend: kernel, transformers integration, statistics."""

from .backend import decoding, sparsify
from .kernel import sparse_attention
from .stats import SparsityStats

__all__ = ["SparsityStats", "decoding", "sparse_attention", "sparsify"]
