"""Top-p (nucleus) attention (Twilight, Tactic): each row keeps the fewest keys holding a fraction p of its softmax.

The keys of a row are ranked by score; the kept set is the shortest prefix of that ranking whose dense probabilities
sum to at least p, plus every key tied with the last one of the prefix (ties at the boundary are kept, so the set
depends on the scores only, never on the order a sort leaves equal keys in). The mass is summed in float64 from the
logits, so the boundary does not move with float32 rounding of the probabilities.

Placement means what it means for Top-k (method.md §1): ``"pre"`` renormalises the kept weights over the kept set
(SDC can put the dropped mass back), ``"post"`` keeps the dense probabilities, which then sum to at least p (VMC can
give the rest to the mean V row). Rows with at most ``k_for(layer)`` valid keys are kept whole, as in Top-k, so
``layer_k={0: 512, 1: 512}`` leaves the same rows dense as the paper's runs.
"""

from __future__ import annotations

import torch

from ..registry import Parameter, register_sparsifier
from .base import FusedRule, ParameterRule, RowBlock, keep_whole_short_rows

# sparsifier.target_kept bisects p over [1e-3, 1]: more mass keeps more keys.
P = Parameter("p", 1e-3, 1.0, log=False, keeps_more_when_higher=True,
              valid="a probability mass in (0, 1], e.g. sparsifier.p=0.9")


@register_sparsifier("topp", label="Top-p", parameter=P)
class TopP(ParameterRule):
    """Per-row, per-head nucleus selection.

    Args:
        p: the probability mass each row keeps, in (0, 1]; p = 1 keeps every valid key (dense).
        placement: ``"pre"`` or ``"post"`` (softmax): the same kept set, normalised as in Top-k.
        k: rows with at most k valid keys are kept whole (None: every row is sparsified).
        layer_k: per-layer overrides of ``k``, e.g. ``{0: 512, 1: 512}``.
    """

    parameter = P
    p: float

    def __init__(self, p: float, placement: str = "post", k: int | None = None, layer_k: dict[int, int] | None = None):
        super().__init__(p, placement, k, layer_k)

    def select(self, rows: RowBlock) -> torch.Tensor | None:
        k = self.k_for(rows.layer)
        if rows.logits.shape[-1] <= k or self.p >= 1.0:  # every row has n ≤ K ≤ k, or p = 1: nothing to drop
            return None
        boundary = nucleus_boundary(rows.logits, rows.row_max, self.p)  # (B, H, Q, 1)
        keep = (rows.logits >= boundary) & rows.valid  # ties with the boundary kept; rows without keys keep none
        return keep_whole_short_rows(keep, rows, k)

    def fused_rule(self, rows: RowBlock) -> FusedRule | None:
        """After the softmax, the fused CPU kernel finds each row's boundary by a selection instead of a sort
        (csrc/select.cpp, ``post_topp``); before it the weights are renormalised over the kept set (plain kernel)."""
        whole = self.fused_whole(rows)
        return None if whole is None or self.p >= 1.0 else FusedRule(whole=whole, p=self.p)


def nucleus_boundary(logits: torch.Tensor, row_max: torch.Tensor, p: float) -> torch.Tensor:
    """(..., 1) the score of the last key each row needs for a mass of p: a row keeps the keys scoring at least it.

    ``logits`` (..., K) with −inf at invalid keys, ``row_max`` (..., 1) each row's maximum (0 for rows without a
    valid key). The keys are ranked by a sort; the mass before each is summed in float64 from the logits."""
    ranked = torch.sort(logits, dim=-1, descending=True).values  # (..., K), -inf (invalid) last
    e = (ranked.double() - row_max.double()).exp_()  # (..., K) exp(s − m), 0 where invalid
    running = e.cumsum(-1)  # (..., K) mass up to each ranked key; the last is the row's total
    before = e.neg_().add_(running)  # mass strictly before each ranked key (in e's buffer)
    needed = (before < p * running[..., -1:]).sum(-1, keepdim=True)  # (..., 1) keys to reach p
    return ranked.gather(-1, (needed - 1).clamp_min(0))  # (..., 1) score of the last key needed
