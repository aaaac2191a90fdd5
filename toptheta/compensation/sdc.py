"""SDC, softmax denominator compensation (method.md §3.1).

Pre-softmax selection renormalises the kept probabilities over the kept set. SDC puts an estimate
E of the dropped exponent mass Σ_{j dropped} exp(s_j − m) back into the denominator, so the kept
weights become exp(s_j − m) / (R + λ·E), with R the kept mass. With ``"exact"`` and λ = 1 the kept
elements get exactly their dense probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..registry import register_compensation
from ..sparsifiers.base import RowBlock
from .lowering import KernelCompensation

ESTIMATORS = ("exact", "exp-threshold", "calibrated")


@register_compensation("sdc", label="SDC", keys=("sdc_scale",), prefers="pre",
                       needs_thresholds=lambda comp: comp.get("sdc") == "calibrated", without_thresholds="null or exact", on="exact")
@dataclass
class SDC:
    """Softmax denominator compensation.

    Args:
        estimator: ``"exact"`` (the dropped logits' own mass), ``"exp-threshold"`` (an upper bound:
            every dropped logit is ≤ min(θ, m), so E ≤ (n − |S|)·exp(min(θ, m) − m); top-θ pre-softmax only), or
            ``"calibrated"`` (the mean dropped mass per layer, head and row length measured during
            calibration and stored in the thresholds).
        scale: λ, multiplying E (1.0 in every paper run).
        thresholds: the source of calibrated masses when the sparsifier is not Top-θ (e.g. top-k
            with offline-calibrated SDC); defaults to the Top-θ sparsifier's own thresholds.
    """

    estimator: str = "exact"
    scale: float = 1.0
    thresholds: object | None = None

    def __post_init__(self):
        self.estimator = {"offline-calibrated": "calibrated"}.get(self.estimator, self.estimator)
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"SDC estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.scale < 0:
            raise ValueError(f"SDC scale λ must be ≥ 0, got {self.scale}")

    @classmethod
    def from_config(cls, comp: dict, thresholds=None) -> "SDC | None":
        """comp.sdc names the estimator (null: off), comp.sdc_scale is λ."""
        if not comp.get("sdc"):
            return None
        return cls(comp["sdc"], scale=float(comp.get("sdc_scale", 1.0)), thresholds=thresholds)

    @property
    def label(self) -> str:
        """Short and stable (metadata, cache keys)."""
        return f"SDC({self.estimator}, λ={float(self.scale)})"

    def lower(self, into: KernelCompensation, placement: str | None) -> KernelCompensation:
        """SDC renormalises pre-softmax weights only; post-softmax weights stay dense probabilities."""
        return replace(into, sdc=self) if placement == "pre" else into

    def check(self, sparsifier, compensations=()) -> None:
        """Refuse combinations that cannot mean anything, naming the fix."""
        if sparsifier.placement != "pre":
            raise ValueError(
                "SDC compensates the softmax denominator, so it needs pre-softmax selection; "
                "post-softmax selection does not renormalise (use VMC alone with placement='post')"
            )
        if self.estimator == "exp-threshold" and not hasattr(sparsifier, "thresholds"):
            raise ValueError("SDC('exp-threshold') needs a threshold sparsifier (TopTheta); use SDC('exact')")
        if self.estimator == "calibrated":
            source = self.thresholds or getattr(sparsifier, "thresholds", None)
            if source is None or getattr(source, "sdc_mass", None) is None:
                raise ValueError(
                    "SDC('calibrated') needs thresholds calibrated with the dropped-mass statistic "
                    "(toptheta.calibrate collects it by default); pass SDC('calibrated', thresholds=...)"
                )

    def dropped_mass(self, rows: RowBlock, kept_sum: torch.Tensor, sparsifier) -> torch.Tensor:
        """λ·E for each row, (B, H, Q, 1) float32, in units of exp(s − m); ``kept_sum`` is R = Σ_kept exp(s − m)."""
        if self.estimator == "exact":
            mass = (rows.row_sum - kept_sum).clamp_min(0.0)  # Σ over valid dropped keys (invalid ones are 0)
        elif self.estimator == "exp-threshold":
            # Only valid dropped keys count (the reference code also counted masked future slots).
            n_dropped = (rows.n.unsqueeze(-1) - rows.counts().unsqueeze(-1)).float()  # (B, H, Q, 1)
            # θ is a logit (pre-softmax only). Every dropped logit is ≤ θ and ≤ the row's maximum m, so each adds at
            # most exp(min(θ, m) − m) ≤ 1. This matters on rows where nothing beats θ (θ > m): they keep their maximum
            # (TopTheta's empty-row rule), and exp(θ − m) per dropped key would overshoot by orders of magnitude.
            bound = torch.exp(torch.minimum(rows.theta, rows.row_max) - rows.row_max)
            mass = torch.where(n_dropped > 0, n_dropped * bound, torch.zeros_like(bound))
        else:
            source = self.thresholds or sparsifier.thresholds
            mass = source.lookup_sdc(rows.layer, rows.n).unsqueeze(-1)  # (B, H, Q, 1)
            dropped_any = rows.counts().unsqueeze(-1) < rows.n.unsqueeze(-1)
            mass = torch.where(dropped_any, mass, torch.zeros_like(mass))
        return self.scale * mass
