"""Top-θ attention (method.md §2.1): keep the valid scores strictly greater than θ(layer, head, n)."""

from __future__ import annotations

import torch

from .base import RowBlock, Sparsifier, check_placement, keep_whole_short_rows


class TopTheta(Sparsifier):
    """Static-threshold selection with thresholds calibrated per layer, head and row length.

    Args:
        thresholds: a :class:`toptheta.Thresholds` (from :func:`toptheta.calibrate` or
            ``Thresholds.load``). It carries the per-layer k: rows with n ≤ k are kept whole, as in
            top-k, so the two sparsifiers touch the same rows.
        placement: ``"pre"`` or ``"post"``; defaults to the placement the thresholds were calibrated
            for. A mismatch is refused: logit thresholds mean nothing as probabilities.

    A row whose every valid score is ≤ θ keeps its largest element,
    rather than attending uniformly to the future as the reference code did (method.md §9, 10a).
    """

    def __init__(self, thresholds, placement: str | None = None):
        placement = check_placement(placement or thresholds.placement)
        if placement != thresholds.placement:
            raise ValueError(
                f"these thresholds were calibrated for placement={thresholds.placement!r}; "
                f"calibrate again with placement={placement!r} or use TopTheta(thresholds)"
            )
        self.thresholds = thresholds
        self.placement = placement

    def k_for(self, layer: int) -> int:
        return self.thresholds.k_for(layer)

    def _theta(self, rows: RowBlock) -> torch.Tensor:
        """θ of each row (B, H, Q), looked up once per block (clamped rows are counted once)."""
        if rows.theta is None:
            theta, clamped = self.thresholds.lookup(rows.layer, rows.n)  # (B, H, Q)
            rows.theta = theta.unsqueeze(-1)  # (B, H, Q, 1), read by exp-threshold SDC
            rows.clamped_rows += clamped
        return rows.theta.squeeze(-1)

    def select(self, rows: RowBlock) -> torch.Tensor:
        self._theta(rows)
        # One comparison keeps the scores above θ and each row's maximum (never an empty row, method.md §9,
        # 10a): lowering θ to just below the row's maximum adds exactly the maximum.
        top = rows.max_score(self.placement)
        cut = torch.minimum(rows.theta, torch.nextafter(top, top.new_tensor(float("-inf"))))
        keep = rows.scores(self.placement) > cut
        # Invalid keys are never above the cut (logits are -inf there, probabilities 0 ≤ θ), except in rows whose
        # cut is negative in probability units (θ = -inf where uncalibrated, or no valid key): those keep
        # every valid key, like the short rows.
        negative = (cut < 0) if self.placement == "post" else None
        return keep_whole_short_rows(keep, rows, self.k_for(rows.layer), also=negative)

    def fused_rule(self, rows: RowBlock) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.placement != "post":
            return None
        theta = self._theta(rows)  # (B, H, Q)
        return theta, (rows.n <= self.k_for(rows.layer)) | (theta < 0)  # as select: short or uncalibrated rows

    def describe(self) -> dict:
        meta = self.thresholds.metadata
        return {"name": "toptheta", "placement": self.placement, "k": meta.get("k"),
                "layer_k": meta.get("layer_k"), "granularity": meta.get("granularity")}

    def __repr__(self) -> str:
        return f"TopTheta(placement={self.placement!r}, thresholds={self.thresholds!r})"
