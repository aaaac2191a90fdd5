"""Top-ρ: Top-k with a budget proportional to the row, each row keeping the ⌈ρ·n⌉ largest of its n valid scores.

Top-k keeps the same k keys of every row longer than k, so a row of n keys keeps k/n of its scores and the longest
rows keep the smallest share. In a few-shot prompt the longest rows are the ones a task scores (the answer's
tokens come last): at one kept fraction over all rows, Top-k and Top-θ calibrated to it keep about half the average
share of those rows, while skip-softmax, whose cut ln(λ/n) lets a row's kept count grow with n, keeps 0.9 of it
(``results/analysis/kept_by_row.md``). Top-ρ gives Top-k that allocation and nothing else: the same exact
ranking, with m = ⌈ρ·n⌉ keys per row (at least one). It separates how a budget is spread over the rows from which
keys a row keeps.

m is computed from ρ·n in float64 less 1e-9·n, so a ρ whose decimal is not exact in binary (0.07 · 100 is
7.000000000000001) does not add a key. Every key tied with the m-th largest score is kept (as top-p keeps ties at
its boundary), so the set depends on the scores alone, never on the order a sort leaves equal keys in.

Placement means what it means for Top-k (method.md §1): ``"pre"`` renormalises the kept weights over the kept set
(SDC can put the dropped mass back), ``"post"`` keeps the dense probabilities (VMC can give the rest to the mean V
row). Rows with at most ``k_for(layer)`` valid keys are kept whole, so ``layer_k={0: 512, 1: 512}`` leaves the same
rows dense as the paper's runs. One ρ serves every layer; it is given (``sparsifier.rho``) or fitted to a target
kept fraction (``sparsifier.target_kept``, ``calibration/target_param.py``). The plain attention path serves it.
"""

from __future__ import annotations

import torch

from ..registry import Parameter, register_sparsifier
from .base import ParameterRule, RowBlock, keep_whole_short_rows

# sparsifier.target_kept searches ρ over [1e-3, 1]: a larger share keeps more keys. It starts at ρ = the target, as
# the rows kept whole (n ≤ k) and the ceiling only add a little, with d log(kept)/dρ = 1/ρ: two steps, not six.
RHO = Parameter("rho", 1e-3, 1.0, log=False, keeps_more_when_higher=True,
                valid="a share of each row's keys in (0, 1], e.g. sparsifier.rho=0.1",
                guess=lambda target: (target, 1 / target))


@register_sparsifier("toprho", label="Top-ρ", parameter=RHO)
class TopRho(ParameterRule):
    """Per-row, per-head top-⌈ρ·n⌉ selection.

    Args:
        rho: the share of each row's valid keys it keeps, in (0, 1]; ρ = 1 keeps every key (dense).
        placement: ``"pre"`` or ``"post"`` (softmax): the same kept set, normalised as in Top-k.
        k: rows with at most k valid keys are kept whole (None: every row is sparsified).
        layer_k: per-layer overrides of ``k``, e.g. ``{0: 512, 1: 512}``.
    """

    parameter = RHO
    rho: float

    def __init__(self, rho: float, placement: str = "post", k: int | None = None,
                 layer_k: dict[int, int] | None = None):
        super().__init__(rho, placement, k, layer_k)

    def select(self, rows: RowBlock) -> torch.Tensor | None:
        k = self.k_for(rows.layer)
        if rows.logits.shape[-1] <= k or self.rho >= 1.0:  # every row has n ≤ K ≤ k, or ρ = 1: nothing to drop
            return None
        boundary = kept_boundary(rows.logits, rows.n, self.rho)  # (B, H, Q, 1)
        keep = (rows.logits >= boundary) & rows.valid  # ties with the m-th kept; rows without keys keep none
        return keep_whole_short_rows(keep, rows, k)


def kept_count(n: torch.Tensor, rho: float) -> torch.Tensor:
    """m = ⌈ρ·n⌉, at least 1 (int64, n's shape): the keys a row of n valid keys keeps (ties aside)."""
    n = n.double()
    return (n * rho - 1e-9 * n).ceil().clamp_min(1).long()


def kept_boundary(logits: torch.Tensor, n: torch.Tensor, rho: float) -> torch.Tensor:
    """(B, H, Q, 1) each row's ⌈ρ·n⌉-th largest logit: the row keeps the scores at or above it.

    ``logits`` (B, H, Q, K) with −inf at invalid keys (they sort last), ``n`` (B, 1, Q) the valid keys per row.
    One sorted top-m call as wide as the chunk's widest m (on the CPU, where reading that width is free; elsewhere
    the whole row, so no layer call waits on the host), then each row's own m-th value."""
    m = kept_count(n, rho).clamp_max(logits.shape[-1])  # (B, 1, Q)
    width = int(m.max()) if logits.device.type == "cpu" else logits.shape[-1]
    ranked = torch.topk(logits, width, dim=-1).values  # (B, H, Q, width), sorted descending
    index = (m - 1).unsqueeze(-1).expand(*logits.shape[:3], 1)  # (B, H, Q, 1)
    return ranked.gather(-1, index)
