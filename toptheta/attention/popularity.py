"""V-row popularity: which V rows the query heads of one GQA group keep, step by step, during a generation.

The paper's decode-time argument (method.md §4) is that a KV group's query heads keep overlapping sets
of V rows, so reading their union costs little more than one head's set. ``VRowPopularity`` is an
observer for ``toptheta.sparsify`` that records the evidence for one layer: at every decode step of the
first generation it sees, per KV group and key position, how many of the group's query heads keep that
V row (0 = the row is not read at all, G = every head of the group keeps it).

Example::

    recorder = VRowPopularity.for_model(model, layer=12, max_steps=64)
    with toptheta.sparsify(model, sparsifier, comp, observer=recorder):
        model.generate(**prompt, max_new_tokens=64)
    recorder.to_dict(group=0)   # {"layer": 12, "group": 0, "heads_per_group": 3, "counts": [[...], ...]}

One generation of batch 1 is recorded: decode steps are recognised as one generation while each step
sees one more key than the last; the first step that does not (the next prompt's generation) ends the
recording. An observer makes the prefill take the plain kernel (observers see every view of the rows),
so recording costs time on the prompt, not on the decode steps.
"""

from __future__ import annotations

import torch

from ..sparsifiers.base import RowBlock
from .backend import model_shape


class VRowPopularity:
    """Observer: per decode step, per KV group and key position, the number of query heads keeping the V row."""

    def __init__(self, layer: int, kv_heads: int, *, max_steps: int | None = None):
        if layer < 0 or kv_heads < 1:
            raise ValueError(f"layer must be >= 0 and kv_heads >= 1, got layer={layer}, kv_heads={kv_heads}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.layer, self.kv_heads, self.max_steps = layer, kv_heads, max_steps
        self.steps: list[torch.Tensor] = []  # one (KV heads, keys) int16 tensor per decode step
        self.heads_per_group: int | None = None
        self.finished = False

    def __call__(self, rows: RowBlock) -> None:
        if self.finished or rows.phase != "decode" or rows.layer != self.layer:
            return
        keep = rows.keep if rows.keep is not None else rows.valid  # dense: every valid row is read
        B, H, Q, K = rows.logits.shape
        if B != 1 or Q != 1:
            raise ValueError(f"VRowPopularity records one generation of batch 1, one token per step; got batch {B}, "
                             f"{Q} tokens per step")
        if self.steps and K != self.steps[-1].shape[-1] + 1:  # not the next step of this generation
            self.finished = True
            return
        if H % self.kv_heads:
            raise ValueError(f"{H} query heads do not split into {self.kv_heads} KV groups")
        keep = keep.expand(B, H, Q, K)[0, :, 0]  # (H, K)
        self.heads_per_group = H // self.kv_heads
        self.steps.append(keep.view(self.kv_heads, self.heads_per_group, K).sum(1).to(torch.int16).cpu())
        if self.max_steps is not None and len(self.steps) >= self.max_steps:
            self.finished = True

    @classmethod
    def for_model(cls, model: torch.nn.Module, layer: int, *, max_steps: int | None = None) -> "VRowPopularity":
        """A recorder for ``layer`` of ``model`` (its KV grouping read from the model)."""
        layers, _, kv_heads = model_shape(model)
        if not 0 <= layer < layers:
            raise ValueError(f"layer must be in [0, {layers}) for this model, got {layer}")
        return cls(layer, kv_heads, max_steps=max_steps)

    def counts(self, group: int = 0) -> torch.Tensor:
        """(steps, keys of the last step) int tensor for one KV group; a step's later keys did not exist yet (0)."""
        if not self.steps:
            return torch.zeros(0, 0, dtype=torch.int16)
        width = self.steps[-1].shape[-1]
        if not 0 <= group < self.steps[0].shape[0]:
            raise ValueError(f"group must be in [0, {self.steps[0].shape[0]}), got {group}")
        out = torch.zeros(len(self.steps), width, dtype=torch.int16)
        for i, step in enumerate(self.steps):
            out[i, : step.shape[-1]] = step[group]
        return out

    def to_dict(self, group: int = 0) -> dict:
        """JSON-ready record (the layout notebooks/vrow_popularity.ipynb and the figure builder read)."""
        counts = self.counts(group)
        return {"layer": self.layer, "group": group, "heads_per_group": self.heads_per_group,
                "steps": int(counts.shape[0]), "counts": counts.tolist()}
