"""Plugging the kernel into transformers, and the ``sparsify`` context manager.

This is the one place that knows transformers' attention interface. We register one attention
function and one mask function under the name ``"toptheta"`` (the mask function matters: without
it transformers builds no causal mask for an unknown implementation name). Registration happens on
first use, not on import. Inside ``sparsify`` the model's attention implementation is switched to
``"toptheta"``; on exit (also on exceptions) the previous one is restored.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..compensation import check_compensation
from ..sparsifiers import Dense, Sparsifier
from .kernel import sparse_attention
from .stats import SparsityStats

IMPLEMENTATION = "toptheta"


@dataclass
class _Session:
    sparsifier: Sparsifier
    compensations: tuple
    stats: SparsityStats
    observer: Callable | None
    chunk_size: int | None


# Attention module -> active session. Weak keys: a model that goes away takes its entry with it.
_SESSIONS: "weakref.WeakKeyDictionary[torch.nn.Module, _Session]" = weakref.WeakKeyDictionary()


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature; returns (output (B, Q, H, D), no weights)."""
    session = _SESSIONS.get(module)
    if session is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attention implementation {IMPLEMENTATION!r} outside a "
            "toptheta.sparsify(...) block; run the model inside the block or set another implementation"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by the toptheta backend")
    valid, bias = _split_mask(attention_mask)
    out = sparse_attention(
        query, key, value, valid,
        scaling=scaling if scaling is not None else query.shape[-1] ** -0.5,
        layer=module.layer_idx,
        sparsifier=session.sparsifier,
        compensations=session.compensations,
        stats=session.stats,
        observer=session.observer,
        chunk_size=session.chunk_size,
        softcap=kwargs.get("softcap"),
        bias=bias,
    )
    return out, None


def _split_mask(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Our mask function gives a boolean mask; a user-supplied additive 4D float mask also works."""
    if mask is None or mask.dtype == torch.bool:
        return mask, None
    valid = mask > torch.finfo(mask.dtype).min / 2
    bias = mask.masked_fill(~valid, 0.0)
    return valid, (bias if bool(bias.any()) else None)


@functools.cache
def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, _attention_forward)
    # sdpa's boolean mask, including its "None when purely causal" shortcut: the kernel then builds the
    # causal mask chunk by chunk, so a 32k-token prefill never holds a 32k × 32k mask.
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that call the attention interface: those carrying a ``layer_idx`` and q/k/v weights."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    if not found:
        raise ValueError(
            f"found no attention modules in {type(model).__name__}: toptheta supports models whose attention "
            "goes through transformers' AttentionInterface (modules with layer_idx and scaling)"
        )
    return found


def model_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, query heads, KV heads) from the model config (text config for multimodal models)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    return config.num_hidden_layers, heads, getattr(config, "num_key_value_heads", None) or heads


@contextlib.contextmanager
def sparsify(
    model: torch.nn.Module,
    sparsifier: Sparsifier | None = None,
    compensation: Sequence = (),
    *,
    stats: bool = True,
    observer: Callable | None = None,
    chunk_size: int | None = None,
) -> Iterator[SparsityStats]:
    """Run ``model`` with sparse attention inside the block; yields the statistics.

    Example::

        with toptheta.sparsify(model, toptheta.TopK(64, "post"), [toptheta.VMC()]) as stats:
            model(**batch)
        stats.kept_attention_fraction

    Args:
        sparsifier: ``Dense()``, ``TopK(...)`` or ``TopTheta(...)`` (default ``Dense()``).
        compensation: any subset of ``[SDC(...), VMC()]``; impossible combinations are refused.
        stats: accumulate sparsity statistics (a few reductions per chunk; off = free).
        observer: called with every :class:`RowBlock` after selection (the calibration hook).
        chunk_size: query rows per chunk; default: see ``kernel.default_rows_per_chunk`` (a few MB a temporary).
    """
    sparsifier = sparsifier or Dense()
    compensation = tuple(compensation or ())
    check_compensation(sparsifier, compensation)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    _check_thresholds_fit(model, sparsifier)
    register()
    modules = attention_modules(model)
    if any(m in _SESSIONS for m in modules):
        raise RuntimeError("this model is already inside a toptheta.sparsify block; nesting is not supported")
    layers, heads, kv_heads = model_shape(model)
    session = _Session(sparsifier, compensation, SparsityStats(layers, heads, kv_heads, enabled=stats),
                       observer, chunk_size)
    previous = model.config._attn_implementation
    for m in modules:
        _SESSIONS[m] = session
    try:
        model.set_attn_implementation(IMPLEMENTATION)
        yield session.stats
    finally:
        for m in modules:
            _SESSIONS.pop(m, None)
        model.set_attn_implementation(previous)


def _check_thresholds_fit(model, sparsifier) -> None:
    thresholds = getattr(sparsifier, "thresholds", None)
    if thresholds is not None:
        thresholds.check_model(model)
