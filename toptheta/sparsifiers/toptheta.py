"""Top-θ attention (method.md §2.1): keep the valid scores strictly greater than θ(layer, head, n)."""

from __future__ import annotations

import torch

from ..registry import register_sparsifier
from .base import FusedRule, RowBlock, Sparsifier, check_placement, keep_whole_short_rows
from .toprho import TopRho, check_head_weights

EMPTY_ROWS = ("keep-max", "reference")
BUDGETS = ("toprho",)  # sparsifier.budget besides the paper's top-k (null)


@register_sparsifier("toptheta", label="Top-θ", needs_thresholds=True,
                     options=("empty_rows", "budget", "rho", "head_weights"))
class TopTheta(Sparsifier):
    """Static-threshold selection with thresholds calibrated per layer, head and row length.

    Args:
        thresholds: a :class:`toptheta.Thresholds` (from :func:`toptheta.calibrate` or
            ``Thresholds.load``). It carries the per-layer k: rows with n ≤ k are kept whole, as in
            top-k, so the two sparsifiers touch the same rows.
        placement: ``"pre"`` or ``"post"``; defaults to the placement the thresholds were calibrated
            for. A mismatch is refused: logit thresholds mean nothing as probabilities.
        empty_rows: what a sparsified row whose every valid score is ≤ θ (an *empty row*) attends to.
            ``"keep-max"`` (default): its largest element, so it never attends to the future and never
            becomes NaN or 0/0. ``"reference"``: as the reference code [R] (method.md §9, 10a) — it keeps
            nothing; pre-softmax without SDC that is uniform attention over the whole padded row of width K,
            future keys included (the kernel does it), with SDC (R = 0) and post-softmax a zero row, β = 1
            with VMC. Either way the rows are counted (``rows.empty``, ``SparsityStats.empty_rows``).

    What θ approximates is the calibration's choice, not the rule's: the paper's budget, each row's k largest scores,
    or with ``sparsifier.budget=toprho`` Top-ρ's ⌈ρ·w·n⌉ (``sparsifier.rho``, fitted by ``sparsifier.target_kept``;
    ``sparsifier.head_weights`` a weight per head, as Top-ρ's), so θ follows a budget that grows with the row and
    differs between heads (``toptheta.calibrate(rho=, head_weights=)``). Those settings only change the calibration.

    With keep-max, exp-threshold SDC bounds each dropped key of such a row by exp(m − m) = 1, not exp(θ − m):
    every dropped logit is ≤ the kept maximum m (see ``compensation/sdc.py``).
    """

    def __init__(self, thresholds, placement: str | None = None, empty_rows: str = "keep-max"):
        if empty_rows not in EMPTY_ROWS:
            raise ValueError(f"empty_rows must be one of {EMPTY_ROWS}, got {empty_rows!r}")
        self.empty_rows = empty_rows
        placement = check_placement(placement or thresholds.placement)
        if placement != thresholds.placement:
            raise ValueError(
                f"these thresholds were calibrated for placement={thresholds.placement!r}; "
                f"calibrate again with placement={placement!r} or use TopTheta(thresholds)"
            )
        self.thresholds = thresholds
        self.placement = placement

    @classmethod
    def from_config(cls, settings: dict, thresholds=None) -> "TopTheta":
        return cls(thresholds, settings["placement"], empty_rows=settings.get("empty_rows") or "keep-max")

    @classmethod
    def check_options(cls, options: dict) -> None:
        budget = options.get("budget")
        if budget is not None and budget not in BUDGETS:
            raise ValueError(f"sparsifier.budget={budget!r}: null (θ for each row's k largest scores, the paper) or "
                             "toprho (θ for Top-ρ's ⌈ρ·n⌉ largest: give sparsifier.rho or sparsifier.target_kept)")
        rho, weights = options.get("rho"), options.get("head_weights")
        if budget is None:
            for key, value in (("rho", rho), ("head_weights", weights)):
                if value is not None:
                    raise ValueError(f"sparsifier.{key}={value!r} sets Top-θ's calibration budget: add "
                                     "sparsifier.budget=toprho, or leave it null")
            return
        if rho is None and options.get("target_kept") is None:
            raise ValueError("sparsifier.budget=toprho needs the share it calibrates to: sparsifier.rho=0.05, or "
                             "sparsifier.target_kept=0.05 to fit it")
        if rho is not None and not TopRho.parameter.accepts(rho):
            raise ValueError(f"sparsifier.rho={rho!r}: {TopRho.parameter.valid}")
        check_head_weights(weights)

    @classmethod
    def check_model(cls, settings: dict, num_layers: int, num_heads, model_name: str) -> None:
        TopRho.check_model(settings, num_layers, num_heads, model_name)

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
        top = rows.max_score(self.placement)  # (B, H, Q, 1)
        # Keep-max: one comparison keeps the scores above θ and each row's maximum (never an empty row, method.md
        # §9, 10a): lowering θ to just below the row's maximum adds exactly the maximum.
        cut = rows.theta
        if self.empty_rows == "keep-max":
            cut = torch.minimum(cut, torch.nextafter(top, top.new_tensor(float("-inf"))))
        keep = rows.scores(self.placement) > cut
        # Invalid keys are never above the cut (logits are -inf there, probabilities 0 ≤ θ), except in rows whose
        # cut is negative in probability units (θ = -inf where uncalibrated, or no valid key): those keep
        # every valid key, like the short rows.
        negative = (cut < 0) if self.placement == "post" else None
        k = self.k_for(rows.layer)
        sparsified = (rows.n > k).unsqueeze(-1) if negative is None else (rows.n > k).unsqueeze(-1) & ~negative
        rows.empty = ((top <= rows.theta) & sparsified).squeeze(-1)  # (B, H, Q): nothing passes θ
        return keep_whole_short_rows(keep, rows, k, also=negative)

    def fused_rule(self, rows: RowBlock) -> FusedRule | None:
        if self.placement != "post" or self.empty_rows != "keep-max":  # the fused kernel always keeps the maximum
            return None
        theta = self._theta(rows)  # (B, H, Q)
        whole = (rows.n <= self.k_for(rows.layer)) | (theta < 0)  # as select: short or uncalibrated rows
        return FusedRule(whole=whole, theta=theta)

    def describe(self) -> dict:
        meta = self.thresholds.metadata
        return {"name": "toptheta", "placement": self.placement, "k": meta.get("k"),
                "layer_k": meta.get("layer_k"), "granularity": meta.get("granularity"), "empty_rows": self.empty_rows,
                **({"budget": meta["budget"]} if meta.get("budget") else {})}

    def __repr__(self) -> str:
        return f"TopTheta(placement={self.placement!r}, empty_rows={self.empty_rows!r}, thresholds={self.thresholds!r})"
