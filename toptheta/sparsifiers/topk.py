"""Top-k attention (method.md §1): each row keeps its k largest valid scores."""

from __future__ import annotations

import torch

from ..registry import register_sparsifier
from .base import FusedRule, RowBlock, Sparsifier, check_placement, keep_whole_short_rows


@register_sparsifier("topk", label="Top-k")
class TopK(Sparsifier):
    """Exact per-row, per-head top-k.

    Args:
        k: keys kept per row in every layer not listed in ``layer_k``.
        placement: ``"pre"`` selects on scaled logits, ``"post"`` on probabilities. Both keep the
            same set (softmax is monotone); they differ in how the kept weights are normalised.
        layer_k: per-layer overrides, e.g. ``{0: 512, 1: 512}`` as in every paper QA run.
    """

    def __init__(self, k: int, placement: str = "post", layer_k: dict[int, int] | None = None):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"TopK needs an integer k ≥ 1, got {k!r}")
        layer_k = {int(layer): int(v) for layer, v in (layer_k or {}).items()}
        if any(v < 1 for v in layer_k.values()):
            raise ValueError(f"every layer_k value must be ≥ 1, got {layer_k}")
        self.k = k
        self.layer_k = layer_k
        self.placement = check_placement(placement)

    @classmethod
    def from_config(cls, settings: dict, thresholds=None) -> "TopK":
        return cls(settings["k"], settings["placement"], settings.get("layer_k"))

    def k_for(self, layer: int) -> int:
        return self.layer_k.get(layer, self.k)

    def select(self, rows: RowBlock) -> torch.Tensor | None:
        k = self.k_for(rows.layer)
        if rows.logits.shape[-1] <= k:  # every row has n ≤ K ≤ k: nothing to drop
            return None
        # Logits and probabilities order the keys identically; logits avoid ties at underflowed 0. A row with
        # n > k has k valid (finite) logits above its masked (-inf) ones, so only short rows need the mask.
        # sorted=False: the same set (the order of the k is never used), without sorting them (~1/3 of the op on CPU)
        if rows.want_next:  # calibration reads each row's (k + 1)-th largest: the same call, one wider, finds it
            top = torch.topk(rows.logits, k + 1, dim=-1, sorted=False)  # (B, H, Q, k + 1)
            last = top.values.argmin(-1, keepdim=True)  # (B, H, Q, 1)
            rows.next_index = top.indices.gather(-1, last)  # a key holding the (k + 1)-th largest value
            keep = torch.zeros_like(rows.logits, dtype=torch.bool).scatter_(-1, top.indices, True)
            keep.scatter_(-1, rows.next_index, False)
            if rows.logits.device.type == "cpu":
                _break_ties_as_topk_k(keep, rows, top.values, last, k)
        else:
            idx = torch.topk(rows.logits, k, dim=-1, sorted=False).indices  # (B, H, Q, k)
            keep = torch.zeros_like(rows.logits, dtype=torch.bool).scatter_(-1, idx, True)
        rows.kept_counts = rows.n.clamp(max=k).expand(keep.shape[:-1])
        return keep_whole_short_rows(keep, rows, k)

    def fused_rule(self, rows: RowBlock) -> FusedRule | None:
        whole = self.fused_whole(rows)
        return None if whole is None else FusedRule(whole=whole, k=self.k_for(rows.layer))

    def describe(self) -> dict:
        return {"name": "topk", "placement": self.placement, "k": self.k, "layer_k": dict(self.layer_k)}

    def __repr__(self) -> str:
        return f"TopK(k={self.k}, placement={self.placement!r}, layer_k={self.layer_k})"


def _break_ties_as_topk_k(keep: torch.Tensor, rows: RowBlock, values: torch.Tensor, last: torch.Tensor,
                          k: int) -> None:
    """Where a row's k-th and (k + 1)-th largest logits are equal, which of the tied keys the k + 1 call leaves out
    is torch.topk's choice, and it need not be the k call's: those rows (a few in a million on real models) take the
    k call's set, so calibration keeps exactly the keys the run's Top-k keeps. On the CPU only, where reading
    ``tied.any()`` is free; elsewhere a tied row keeps another of the tied keys, an exact top-k all the same."""
    kth = values.scatter(-1, last, float("inf")).amin(-1)  # (B, H, Q) the k-th largest
    tied = (kth == values.gather(-1, last)[..., 0]) & (rows.n > k)  # rows of n ≤ k are kept whole anyway
    if bool(tied.any()):
        logits = rows.logits[tied]  # (T, K)
        idx = torch.topk(logits, k, dim=-1, sorted=False).indices
        keep[tied] = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)
