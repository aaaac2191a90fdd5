"""What the evaluation code reads off a model or its tokenizer, in one low module that imports no other evaluation one.

The lm-eval wrappers (``batched_lm``, ``shared_context_lm``), the greedy decoders (``greedy``, ``prefix_sharing``) and
the generation tasks all ask the same questions: which statistics the model's ``toptheta.sparsify`` block
collects, which layers attend within a sliding window, and which token pads a batch. Answering them here
keeps those modules from importing each other for a helper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..attention import backend

if TYPE_CHECKING:
    from ..attention.stats import SparsityStats


def active_stats(model) -> SparsityStats | None:
    """The statistics of the ``toptheta.sparsify`` block ``model`` is in (None outside one, or when off)."""
    stats = backend.session_statistics(model)
    return stats if stats is not None and stats.enabled else None


def has_sliding_window(model) -> bool:
    """Whether some layer of ``model`` attends within a sliding window (transformers masks those itself)."""
    return any(window is not None for window in layer_windows(model))


def layer_windows(model) -> list[int | None]:
    """Each layer's sliding window in keys (None: the layer attends to every earlier key), from the model's config:
    ``layer_types`` where it has them (Gemma-3: five sliding layers of every six), else one ``sliding_window`` for
    every layer when the config uses it."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if "sliding" in str(kind) else None for kind in layer_types]
    uses = window is not None and getattr(config, "use_sliding_window", True)
    return [window if uses else None] * config.num_hidden_layers


def pad_token_id(tokenizer) -> int:
    """The token that pads a batch: the tokenizer's pad token, else its end-of-sequence token, else 0."""
    for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    return 0
