"""Skip-softmax (BLASST; TensorRT-LLM, FlashInfer, SGLang, Model-Optimizer): one global λ, no calibration per head.

A row of n valid keys with maximum score m drops every score s with

    s < m + ln(λ / n),    i.e.  exp(s − m) < λ / n,

so a key survives when its probability is at least λ/n times the row's largest one: a key's share of a uniform row
is 1/n, and λ says how far below that share a key may fall. One λ serves every layer, head and row length; it is
given (``sparsifier.lam``) or fitted to a target kept fraction on calibration rows (``sparsifier.target_kept``,
``calibration/target_param.py``). Scores tied with the cut are kept. When λ > n the cut lies above m and the rule
would keep nothing: such a row keeps its maximum (as Top-θ's ``keep-max``) and is counted in ``rows.empty``.

This is the exact rule, with the true row maximum. The tiled kernels that ship it compare against the *running*
maximum m̃_t of the tiles seen so far (m̃_t ≤ m) and skip whole tiles whose largest score falls below the cut. Their
cut m̃_t + ln(λ/n) is lower before the row's maximum has been seen, and a tile survives when any one of its scores
does, so they drop a subset of what this rule drops (they keep more); the two agree on every tile processed after
the one holding the maximum. The kept fraction here is therefore the sparsity the rule promises, a lower bound on
what a tiled kernel keeps. Our Triton kernels (attention/triton/) apply this exact rule on a GPU: a first pass over
the keys finds each row's maximum, the second cuts at it (:meth:`cut_offsets` gives them ln(λ/n) per row).

Placement: BLASST drops a skipped tile from the numerator and the denominator of the softmax, i.e. ``"pre"`` (the
kept weights are renormalised; SDC can put the dropped mass back); ``"post"`` keeps the dense probabilities (VMC
can give the rest to the mean V row). The kept set is the same. Rows with at most ``k_for(layer)`` keys are kept
whole, as in Top-k.
"""

from __future__ import annotations

import math

import torch

from ..registry import Parameter, register_sparsifier
from .base import FusedRule, ParameterRule, RowBlock, keep_whole_short_rows

# sparsifier.target_kept bisects log λ over [1e-6, 1e4]: a larger λ keeps fewer keys.
LAM = Parameter("lam", 1e-6, 1e4, log=True, keeps_more_when_higher=False, valid="a finite λ > 0, e.g. sparsifier.lam=1.0")


@register_sparsifier("skipsoftmax", label="Skip-softmax", parameter=LAM)
class SkipSoftmax(ParameterRule):
    """Drop s < m + ln(λ/n), per row; see the module docstring.

    Args:
        lam: λ > 0, the one threshold of the model (BLASST's λ; e.g. 1e-3 drops keys below 1/1000 of a uniform
            share, relative to the row's largest probability).
        placement: ``"pre"`` (BLASST) or ``"post"``.
        k: rows with at most k valid keys are kept whole (None: every row is sparsified).
        layer_k: per-layer overrides of ``k``, e.g. ``{0: 512, 1: 512}``.
    """

    parameter = LAM
    lam: float

    def __init__(self, lam: float, placement: str = "pre", k: int | None = None,
                 layer_k: dict[int, int] | None = None):
        super().__init__(lam, placement, k, layer_k)

    def cut(self, rows: RowBlock) -> torch.Tensor:
        """(B, H, Q, 1) float32 c such that s ≥ c exactly when s ≥ m + ln(λ/n) in float64, the maximum always kept.

        The cut is found in float64 and rounded up to the next float32: comparing a float32 score with it then
        decides as the float64 comparison does (no float32 lies strictly between the two).
        """
        m = rows.row_max.double()  # (B, H, Q, 1)
        exact = torch.minimum(m + self._log_share(rows.n.unsqueeze(-1)), m)  # keep-max: never past the maximum
        cut = exact.float()
        return torch.where(cut.double() < exact, torch.nextafter(cut, cut.new_tensor(math.inf)), cut)

    def _log_share(self, n: torch.Tensor) -> torch.Tensor:
        """ln(λ/n) in float64 for rows of n valid keys (n ≥ 1 assumed: rows without keys keep nothing anyway)."""
        return torch.log(self.lam / n.double().clamp_min(1.0))

    def cut_offsets(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        """The compiled kernels' form of the rule: ln(λ/n) per row (float64, n's shape), −inf for rows kept whole
        (n ≤ k_for(layer)); a kernel cuts a row at min(m + offset, m) with its own maximum m, in float64 rounded up
        to float32 as :meth:`cut` (attention/triton/prefill.py, ``skip_cut``)."""
        return self._log_share(n).masked_fill(n <= self.k_for(layer), float("-inf"))

    def select(self, rows: RowBlock) -> torch.Tensor | None:
        k = self.k_for(rows.layer)
        if rows.logits.shape[-1] <= k:  # every row has n ≤ K ≤ k: nothing to drop
            return None
        keep = rows.logits >= self.cut(rows)  # (B, H, Q, K); invalid keys are -inf, below any cut
        rows.empty = self.empty_mask(rows)
        return keep_whole_short_rows(keep, rows, k)

    def empty_mask(self, rows: RowBlock) -> torch.Tensor:
        """(B, H, Q) rows where λ > n: the rule's cut is above the maximum, nothing would pass (kept: the maximum, and
        ties); rows kept whole are not counted. The CPU paths (plain, fused selection, one-pass prefill) use it."""
        k = self.k_for(rows.layer)
        return ((rows.n > k) & (rows.n > 0) & (rows.n < self.lam)).expand(rows.logits.shape[:3])

    def fused_rule(self, rows: RowBlock) -> FusedRule | None:
        """After the softmax, the fused CPU selection compares each row with its cut (csrc/select.cpp, ``post_cut``)
        where the one-pass prefill (attention/prefill.py, which takes :meth:`cut_offsets` at either placement) is off;
        before it, without that kernel, the plain kernel renormalises the weights over the kept set."""
        whole = self.fused_whole(rows)
        if whole is None:
            return None
        return FusedRule(whole=whole, cut=self.cut(rows)[..., 0], empty=self.empty_mask(rows))
