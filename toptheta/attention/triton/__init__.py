"""Triton kernels for Top-θ attention on GPUs (tested on CPU in Triton's interpreter, TRITON_INTERPRET=1).

* ``prefill.prefill_attention``: flash-attention tiles; pre-softmax Top-θ in one pass, post-softmax in two;
  skip-softmax (``cut_offset``: one λ, the cut taken from each row's true maximum) in two.
* ``decode.decode_attention``: a few query rows over a cache; the G heads of a KV group in one program, V read
  only at the rows some head keeps, the kept V rows (union over the group) counted; Top-k and top-p through a
  ``boundary`` found in the logits between its launches.
* ``lowering``: per-row θ and calibrated SDC masses from a ``TopTheta`` sparsifier, Top-k's and top-p's boundary
  rules, and the statistics back.

Importing this package imports nothing heavy: the kernels (and triton) load on first use of a wrapper.
"""

from __future__ import annotations

import importlib
import importlib.util

__all__ = ["available", "prefill_attention", "decode_attention"]


def available() -> bool:
    """Whether triton can be imported here (the kernels still need CUDA tensors unless TRITON_INTERPRET=1)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("triton.language")
    except Exception:  # a broken install is as good as none
        return False
    return True


def __getattr__(name: str):
    if name == "prefill_attention":
        return importlib.import_module(".prefill", __name__).prefill_attention
    if name == "decode_attention":
        return importlib.import_module(".decode", __name__).decode_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
