"""What a sparsifier is: a rule that says which elements of each attention row survive.

A sparsifier sees one chunk of rows at a time (see ``toptheta.attention.kernel``) and returns a
boolean keep-mask. It never touches the softmax or the values: compensation and the output are the
kernel's job, so a new selection rule is one small class.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEMENTS = ("pre", "post")


@dataclass
class RowBlock:
    """One chunk of attention rows of one layer, as the kernel sees it.

    Shapes use B (batch), H (query heads), Q (rows in the chunk), K (keys in the chunk window).
    Everything is float32 whatever the model dtype. A row's length n counts its valid keys: causal,
    not padding, inside any sliding window (method.md §2.1).
    """

    layer: int
    phase: str  # "prefill" (the call had Q > 1 rows) or "decode" (one new token)
    logits: torch.Tensor  # (B, H, Q, K) scaled scores, -inf where invalid
    exp_scores: torch.Tensor  # (B, H, Q, K) exp(logits - row_max), 0 where invalid
    row_sum: torch.Tensor  # (B, H, Q, 1) Σ exp_scores: the dense softmax denominator
    row_max: torch.Tensor  # (B, H, Q, 1) max valid logit, 0 for rows with no valid key
    valid: torch.Tensor  # (B, 1, Q, K) bool
    n: torch.Tensor  # (B, 1, Q) long
    keep: torch.Tensor | None = None  # (B, H, Q, K) bool once a sparsifier has chosen (None = all)
    theta: torch.Tensor | None = None  # (B, H, Q, 1) per-row threshold, set by threshold sparsifiers
    clamped_rows: int = 0  # rows longer than any calibrated row length (threshold lookups clamp)
    _probs: torch.Tensor | None = None

    @property
    def probs(self) -> torch.Tensor:
        """Dense softmax probabilities (B, H, Q, K), 0 where invalid; computed on first use."""
        if self._probs is None:
            self._probs = self.exp_scores / self.row_sum.clamp_min(torch.finfo(torch.float32).tiny)
        return self._probs

    def scores(self, placement: str) -> torch.Tensor:
        """The values a placement selects on: scaled logits (pre) or probabilities (post)."""
        return self.logits if placement == "pre" else self.probs

    def kth_largest(self, k: int, placement: str) -> torch.Tensor:
        """The k-th largest valid score of each row (B, H, Q), ``-inf`` where n < k.

        With k + 1 this is τ of method.md §2.2: used as a strict threshold it keeps exactly k.
        Logits order keys like probabilities and have no ties at underflowed zeros, so the order
        statistic is found on logits and read off in the requested units.
        """
        k_eff = min(k, self.logits.shape[-1])
        values, idx = torch.topk(self.logits, k_eff, dim=-1)  # (B, H, Q, k)
        kth = self.scores(placement).gather(-1, idx[..., -1:]).squeeze(-1)
        short = self.n.expand_as(kth) < k
        return kth.masked_fill(short, float("-inf"))


class Sparsifier:
    """Base class. Subclasses set ``placement`` and implement :meth:`select`."""

    placement: str | None = None  # None for dense

    def k_for(self, layer: int) -> int | None:
        """Budget of a layer: rows with at most this many valid keys are kept whole (None = dense)."""
        return None

    def select(self, rows: RowBlock) -> torch.Tensor | None:
        """Keep-mask (B, H, Q, K), a subset of ``rows.valid``; None means keep every valid key."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": type(self).__name__.lower(), "placement": self.placement}


def check_placement(placement: str) -> str:
    aliases = {"pre-softmax": "pre", "post-softmax": "post"}
    placement = aliases.get(placement, placement)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be 'pre' or 'post' (softmax), got {placement!r}")
    return placement


def keep_whole_short_rows(keep: torch.Tensor, rows: RowBlock, k: int) -> torch.Tensor:
    """Rows with n ≤ k are not sparsified (method.md §1): they keep every valid key."""
    short = (rows.n <= k).unsqueeze(-1)  # (B, 1, Q, 1)
    return torch.where(short, rows.valid, keep)
