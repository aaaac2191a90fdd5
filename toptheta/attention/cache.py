"""A KV cache that grows in place: ``growing_cache(model)`` for ``model.generate(cache=...)``.

transformers' ``DynamicLayer`` appends each new token with ``torch.cat`` of the whole cache, so a decode step
copies every layer's K and V: at 8k tokens on SmolLM2-135M that was 61 % of a step's time (torch profiler,
``aten::cat``), more than attention and the linear layers together. ``GrowingLayer`` keeps K and V in buffers
with spare room along the sequence and writes the new tokens into them; ``keys``/``values`` are views of the
filled part, so the attention code sees the tensors it always saw (each (sequence, head) slab contiguous; the
head stride is the buffer's capacity). When the room runs out, the buffer grows by a quarter (at least
``MIN_ROOM`` tokens), so copies are amortised O(1) per token and the spare memory stays ≤ 25 %.

Sliding-window layers keep transformers' own classes (they roll their window, no growth to amortise).
Everything that replaces ``keys``/``values`` from outside (crop, beam reordering, batch selection, offloading)
is noticed at the next ``update``, which then starts a new buffer from the tensors it finds.

With ``backend.py``, this is the project's transformers-specific code (``DynamicCache``'s layer list, through
``toptheta.compat``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch
from transformers import DynamicCache

from ..compat import DynamicLayer, cache_layers, set_cache_layers

MIN_ROOM = 256  # tokens of spare room at least, when a buffer grows


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with amortised O(1) appends; same results, same interface."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if not self._owns_views() or n + t > self._kbuf.shape[-2] or not self._fits(key_states, value_states):
            self._grow(n, n + t, key_states, value_states)
        self._kbuf[..., n:n + t, :] = key_states
        self._vbuf[..., n:n + t, :] = value_states
        self.keys, self.values = self._kbuf[..., :n + t, :], self._vbuf[..., :n + t, :]
        return self.keys, self.values

    def _owns_views(self) -> bool:
        """Whether keys/values are still the views this layer handed out (nobody replaced them since)."""
        return (self._kbuf is not None and self.keys.numel() > 0
                and self.keys.data_ptr() == self._kbuf.data_ptr() and self.values.data_ptr() == self._vbuf.data_ptr()
                and self.keys.stride() == self._kbuf.stride() and self.values.stride() == self._vbuf.stride())

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        return (self._kbuf.shape[:2] == key_states.shape[:2] and self._kbuf.shape[-1] == key_states.shape[-1]
                and self._vbuf.shape[-1] == value_states.shape[-1] and self._kbuf.dtype == key_states.dtype
                and self._kbuf.device == key_states.device)

    def _grow(self, n: int, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """New buffers with room for ``need`` tokens and a quarter more; the current n tokens copied in."""
        capacity = need + max(MIN_ROOM, need // 4)
        B, H, _, D = key_states.shape
        kbuf = key_states.new_empty(B, H, capacity, D)
        vbuf = value_states.new_empty(B, H, capacity, value_states.shape[-1])
        if n:
            kbuf[..., :n, :] = self.keys
            vbuf[..., :n, :] = self.values
        self._kbuf, self._vbuf = kbuf, vbuf


def cache_prefix(cache: DynamicCache, length: int) -> DynamicCache:
    """A cache holding the first ``length`` positions of ``cache``, which stays as it was (continue several
    sequences from one shared prefix). The copy's layers start as views and copy them when they first grow.
    Sliding-window layers roll their window and cannot be cut at a position: refused."""
    part = copy.copy(cache)
    layers = []
    for layer in cache_layers(cache):
        if type(layer) not in (DynamicLayer, GrowingLayer):
            raise ValueError(f"a {type(layer).__name__} cannot be cut at a position (sliding-window layers roll "
                             "their cache); share no prefix with this model")
        if length > layer.get_seq_length():
            raise ValueError(f"the cache holds {layer.get_seq_length()} positions, fewer than {length}")
        own = copy.copy(layer)
        own.keys, own.values = layer.keys[..., :length, :], layer.values[..., :length, :]
        if isinstance(own, GrowingLayer):
            own._kbuf = own._vbuf = None  # the views are not its own: its first update copies them
        layers.append(own)
    set_cache_layers(part, layers)
    return part


def select_rows(cache: DynamicCache, rows: torch.Tensor, *, room: int = 0,
                ends: torch.Tensor | None = None) -> DynamicCache:
    """A cache holding batch rows ``rows`` (repeats allowed) of ``cache``, which stays as it was, in one copy.

    Full-attention layers get ``GrowingLayer`` buffers with spare room for ``room`` more positions, so the next
    forwards of up to that many tokens write into them instead of copying the cache again. With ``ends`` ((R,): of
    every selected row, how many leading positions are valid, the rest right padding), each row's valid positions
    are moved to the end and its padding before them (left-padded, as a batch of whole sequences would be; the
    padding's entries come along, rotated). Sliding-window layers (they roll their window) keep transformers' own
    row selection, without room; ``ends`` is refused there.
    """
    selected = copy.copy(cache)
    layers = []
    for layer in cache_layers(cache):
        own = copy.copy(layer)
        if type(layer) not in (DynamicLayer, GrowingLayer) or layer.keys.numel() == 0:
            if ends is not None:
                raise ValueError(f"a {type(layer).__name__} cannot be re-padded: its positions are not fixed")
            own.batch_select_indices(rows)
        else:
            spare = room if type(layer) is GrowingLayer else 0  # a DynamicLayer concatenates: room would go unused
            kbuf, vbuf = _copy_rows(layer.keys, rows, spare, ends), _copy_rows(layer.values, rows, spare, ends)
            K = layer.keys.shape[-2]
            own.keys, own.values = kbuf[:, :, :K], vbuf[:, :, :K]
            if type(layer) is GrowingLayer:
                own._kbuf, own._vbuf = kbuf, vbuf  # views it owns: its next update writes into the room
        layers.append(own)
    set_cache_layers(selected, layers)
    return selected


def _copy_rows(x: torch.Tensor, rows: torch.Tensor, room: int, ends: torch.Tensor | None) -> torch.Tensor:
    """Rows of x (B, Hkv, K, D) copied into a new buffer (R, Hkv, K + room, D), one slab copy per row (no
    temporary: a batch of gathered rows would be copied twice)."""
    K = x.shape[-2]
    buf = x.new_empty(len(rows), x.shape[1], K + room, x.shape[-1])
    for r, b in enumerate(rows.tolist()):
        if ends is None:
            buf[r, :, :K] = x[b]
        else:
            end = int(ends[r])
            buf[r, :, K - end:K] = x[b, :, :end]  # the valid positions last
            buf[r, :, :K - end] = x[b, :, end:]  # the padding first
    return buf


def grows(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` is a ``GrowingLayer`` (what :func:`dropping_appends` needs)."""
    return all(type(layer) is GrowingLayer for layer in cache_layers(cache))


@contextlib.contextmanager
def dropping_appends(cache: DynamicCache):
    """Forwards inside append to ``cache`` as usual; on exit every layer is cut back to the length it had on entry.

    Scores several batches of continuations against one cached context without a copy of the cache per batch:
    each batch writes its keys and values into the growing layers' spare room and leaves it to the next. Only for
    caches whose layers all grow (``GrowingLayer``, e.g. from :func:`select_rows`): refused otherwise.
    """
    if not grows(cache):
        raise ValueError("dropping_appends needs growing layers only (select_rows or growing_cache makes them)")
    layers = cache_layers(cache)
    lengths = [layer.get_seq_length() for layer in layers]
    try:
        yield cache
    finally:
        for layer, n in zip(layers, lengths):
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]


def forward_accepts(model, name: str) -> bool:
    """Whether ``model.forward`` takes the keyword ``name`` (e.g. ``logits_to_keep``)."""
    return name in inspect.signature(model.forward).parameters


def cache_keyword(model) -> str:
    """The forward's keyword for a KV cache: ``cache`` (transformers 5.x renamed it) or ``past_key_values``."""
    return "cache" if forward_accepts(model, "cache") else "past_key_values"


def growing_cache(model) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` whose full-attention layers are ``GrowingLayer``s.

    Pass it to ``model.generate(..., cache=growing_cache(model))`` (``past_key_values=`` before transformers 5.x
    renamed it); one cache per generate call.
    """
    cache = DynamicCache(config=model.config)
    set_cache_layers(cache, [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache_layers(cache)])
    return cache
