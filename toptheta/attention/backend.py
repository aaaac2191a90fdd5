"""Plugging the kernel into transformers, and the ``sparsify`` context manager.

This is the one place that knows transformers' attention interface. We register one attention
function and one mask function under the name ``"toptheta"`` (the mask function matters: without
it transformers builds no causal mask for an unknown implementation name). Registration happens on
first use, not on import. Inside ``sparsify`` the model's attention implementation is switched to
``"toptheta"``; on exit (also on exceptions) the previous one is restored.

Two things the kernel cannot see from tensor shapes are settled here:

* **Causal alignment.** The kernel reads ``valid=None`` as "causal, the queries are the last Q keys".
  transformers also passes None for an upper-left aligned causal mask (a static cache's prefill: K = cache
  length > Q, the empty slots after the prompt). Our mask function asks the cache where the queries sit
  (``q_offset``) and materialises the mask unless the queries really end at the last key.
* **Phase.** Prefill or decode is decided by what the model is doing, not by Q: the forwards of
  ``model.generate`` after the prompt are decode steps, everything else (the prompt, every scoring pass,
  continuations scored against a cached context, one-token prompts) is prefill. See :class:`_Phases`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from .. import compat
from ..compensation import check_compensation
from ..sparsifiers import Dense, Sparsifier
from ..thresholds import check_thresholds_fit
from . import decode
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
    phase: str = "prefill"  # of the model's current forward; set by _Phases
    forced_phase: str | None = None  # set by decoding()


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
        phase=session.forced_phase or session.phase,
    )
    return out, None


def _split_mask(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Our mask function gives a boolean mask; a user-supplied additive 4D float mask also works."""
    if mask is None or mask.dtype == torch.bool:
        return mask, None
    valid = mask > torch.finfo(mask.dtype).min / 2
    bias = mask.masked_fill(~valid, 0.0)
    if mask.device.type != "cpu":  # whether the bias is all zeros is a host read there: keep it
        return valid, bias
    return valid, (bias if bool(bias.any()) else None)


@functools.cache
def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    compat.register_attention(IMPLEMENTATION, _attention_forward, _mask)


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, *args, allow_is_causal_skip=True, **kwargs):
    """sdpa's boolean mask, with its "None when purely causal" shortcut only where the kernel reads None right.

    None lets the kernel build the causal mask chunk by chunk (a 32k-token prefill never holds a 32k × 32k mask),
    but the kernel reads None as lower-right aligned: query i sits at key K − Q + i. sdpa's None also covers
    upper-left alignment (a static cache's prefill: queries at 0..Q−1 of a longer, partly empty cache), so the
    shortcut is kept only when the cache says the queries end at the last key. A bidirectional None (no mask at
    all) is never kept.
    """
    kwargs["allow_is_bidirectional_skip"] = False
    if allow_is_causal_skip:
        allow_is_causal_skip = _queries_end_at_last_key(q_offset, q_length, kv_offset, kv_length)
    return compat.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, *args,
                            allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _queries_end_at_last_key(q_offset, q_length: int, kv_offset: int, kv_length: int) -> bool:
    """Whether the last query sits at the last key (positions from the cache: q_offset is its length before this call)."""
    if isinstance(q_offset, torch.Tensor):  # static caches hand a tensor; under tracing it cannot be read
        if q_offset.numel() != 1 or torch.compiler.is_compiling():
            return False
        q_offset = int(q_offset)
    return q_offset + q_length == kv_offset + kv_length


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules that call the attention interface: those carrying a ``layer_idx`` and q/k/v weights."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    if not found:
        raise ValueError(
            f"found no attention modules in {type(model).__name__}: toptheta supports models whose attention "
            "goes through transformers' AttentionInterface (modules with layer_idx and scaling)"
        )
    return found


def _refuse_sinks(model: torch.nn.Module, modules: list[torch.nn.Module]) -> None:
    """Attention sinks (a learned logit per head that takes part in every softmax, e.g. gpt-oss) are not modelled by
    the kernel: refuse such a model when it enters ``sparsify``, before any forward."""
    with_sinks = [m for m in modules if isinstance(getattr(m, "sinks", None), torch.Tensor)]
    if with_sinks:
        raise NotImplementedError(
            f"{type(model).__name__} has attention sinks ({type(with_sinks[0]).__name__}.sinks, {len(with_sinks)} "
            "layers): toptheta's kernel has no sink logit in its softmax, so it cannot sparsify this model; use a "
            "model without sinks (LLaMA, Mistral, Qwen2, Gemma-3)")


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, before anything is evaluated, a model toptheta cannot sparsify: no attention modules, attention sinks,
    or attention modules that never call transformers' attention interface (custom modeling code that computes
    attention itself would otherwise run dense, with no statistics). One forward of one token tells."""
    layers = model_shape(model)[0]
    device = model.get_input_embeddings().weight.device
    with sparsify(model) as stats, torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
        reached = (stats.rows.sum(-1) > 0).tolist()  # (L,) layers whose attention came through our function
    silent = [layer for layer in range(layers) if not reached[layer]]
    if silent:
        raise ValueError(
            f"{type(model).__name__}'s attention in layer(s) {silent} of {layers} does not go through transformers' "
            "attention interface (its modeling code computes attention itself), so toptheta would run it dense and "
            "measure nothing; use a model whose attention dispatches through AttentionInterface (LLaMA, Mistral, "
            "Qwen2, Gemma-3), or port its attention module to it")


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
    check_thresholds_fit(model, sparsifier, compensation)
    register()
    modules = attention_modules(model)
    _refuse_sinks(model, modules)
    if any(m in _SESSIONS for m in modules):
        raise RuntimeError("this model is already inside a toptheta.sparsify block; nesting is not supported")
    layers, heads, kv_heads = model_shape(model)
    beyond = sorted(layer for layer in getattr(sparsifier, "layer_k", None) or {} if not 0 <= layer < layers)
    if beyond:
        raise ValueError(f"layer_k names layer(s) {beyond}, but {type(model).__name__} has {layers} layers "
                         f"(0..{layers - 1}): drop them from layer_k")
    session = _Session(sparsifier, compensation, SparsityStats(layers, heads, kv_heads, enabled=stats),
                       observer, chunk_size)
    previous = model.config._attn_implementation
    for m in modules:
        _SESSIONS[m] = session
    try:
        model.set_attn_implementation(IMPLEMENTATION)
        with _Phases(model, session):
            yield session.stats
    finally:
        for m in modules:
            _SESSIONS.pop(m, None)
        model.set_attn_implementation(previous)
        decode.reset()


@contextlib.contextmanager
def decoding(model: torch.nn.Module) -> Iterator[None]:
    """Inside a ``sparsify`` block, count every forward of ``model`` as a decode step (hand-written decoding loops).

    ``model.generate`` needs nothing: its steps after the prompt are decode steps on their own.
    """
    session = _SESSIONS.get(attention_modules(model)[0])
    if session is None:
        raise RuntimeError("toptheta.decoding(model) needs the model inside a toptheta.sparsify(...) block")
    previous, session.forced_phase = session.forced_phase, "decode"
    try:
        yield
    finally:
        session.forced_phase = previous


def session_statistics(model: torch.nn.Module):
    """The statistics of the ``sparsify`` block ``model`` is in, or None outside one."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    session = _SESSIONS.get(modules[0]) if modules else None
    return None if session is None else session.stats


@contextlib.contextmanager
def statistics_paused(model: torch.nn.Module) -> Iterator[None]:
    """Inside a ``sparsify`` block, record no statistics for the forwards of this block (lm-eval's batch-size probe,
    warm-up runs): only evaluated requests are counted. Outside one, nothing to pause."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    session = _SESSIONS.get(modules[0]) if modules else None
    if session is None:
        yield
        return
    with session.stats.paused():
        yield


def is_sparsified(model: torch.nn.Module) -> bool:
    """Whether ``model`` is inside a ``sparsify`` block now."""
    modules = attention_modules(model)
    return bool(modules) and modules[0] in _SESSIONS


class _Phases:
    """Sets ``session.phase`` before each forward of the model: decode for the steps of ``generate`` after the prompt.

    ``model.generate`` is wrapped for the block (an instance attribute, removed on exit), so the session knows that a
    generation runs and how long its prompt is; a forward pre-hook then marks a forward as a decode step when it is
    not the generation's first forward and the cache already holds the whole prompt. A chunked prefill, a restart
    from a cache and the prompt of assisted decoding therefore stay prefill, and assisted or speculative
    verification steps (several tokens at once) are decode. Outside ``generate`` every forward is prefill: a scoring
    pass, a continuation scored against a cached context, a one-token prompt. Without a KV cache every step of
    ``generate`` recomputes the whole sequence and counts as prefill. Only public pieces of transformers are used:
    ``generate``, forward pre-hooks and the cache's ``get_seq_length``.
    """

    def __init__(self, model: torch.nn.Module, session: _Session):
        self.model, self.session = model, session
        self.prompt_end: int | None = None  # while generate runs: positions [0, prompt_end) are the prompt
        self.forwards = 0  # forwards of the running generate call so far

    def __enter__(self):
        model, self.wrapper, self.hook = self.model, None, None
        self.shadowed = vars(model).get("generate")  # an instance attribute of the same name, restored on exit
        original = getattr(model, "generate", None)
        if callable(original):
            @functools.wraps(original)
            def generate(*args, **kwargs):
                saved = self.prompt_end, self.forwards
                self.prompt_end, self.forwards = _prompt_length(args, kwargs), 0
                decode.reset()  # running V sums belong to one generation's cache, never to the next one
                try:
                    return original(*args, **kwargs)
                finally:
                    self.prompt_end, self.forwards = saved
                    self.session.phase = "prefill"

            self.wrapper = model.generate = generate
        self.hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        if self.wrapper is not None and vars(self.model).get("generate") is self.wrapper:
            if self.shadowed is None:
                del self.model.generate
            else:
                self.model.generate = self.shadowed
        self.session.phase = "prefill"

    def _before_forward(self, module, args, kwargs):
        self.session.phase = self.session.forced_phase or self._phase(kwargs)

    def _phase(self, kwargs) -> str:
        if self.prompt_end is None:
            return "prefill"
        first, self.forwards = self.forwards == 0, self.forwards + 1
        if first:
            return "prefill"
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        try:
            cached = int(cache.get_seq_length()) if cache is not None else 0
        except (AttributeError, TypeError):  # a cache we cannot ask: every step after the first is decode
            cached = self.prompt_end
        return "decode" if cached >= self.prompt_end else "prefill"


def _prompt_length(args, kwargs) -> int:
    """Prompt length of a ``generate`` call: the widest of its input ids, embeddings and attention mask (≥ 1)."""
    given = [kwargs.get(name) for name in ("input_ids", "inputs", "inputs_embeds", "attention_mask")] + list(args[:1])
    return max((t.shape[1] for t in given if isinstance(t, torch.Tensor) and t.dim() >= 2), default=1)
