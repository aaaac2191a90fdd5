"""What toptheta knows about a loaded model (``ModelInfo``), and the error raised when a model cannot be had here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class ModelUnavailableError(RuntimeError):
    """The requested model cannot be obtained here (missing wheel, offline hub, corrupt file)."""


# ----------------------------------------------------------------------------------------------------------
# Model description
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of toptheta needs to know about a loaded model, without touching the model itself.

    ``source`` is where the weights came from (a directory, a hub id, or a description of the tiny model);
    ``revision`` is the hub commit, the GGUF checksum for packaged models, or None.
    """

    name: str
    source: str
    revision: str | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    model_type: str = ""

    def fingerprint(self) -> str:
        """The attention geometry as a short string; calibrated thresholds are only valid for an equal one."""
        return f"L{self.num_layers}-H{self.num_heads}-KV{self.num_kv_heads}-D{self.head_dim}"

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, for results files."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Any, *, name: str, source: str, revision: str | None) -> "ModelInfo":
        """Read the attention geometry from a transformers config (the text part of a composite one)."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            name=name,
            source=source,
            revision=revision,
            num_layers=int(text.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            model_type=str(getattr(text, "model_type", "")),
        )
