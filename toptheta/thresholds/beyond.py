"""Thresholds for rows longer than any calibrated row (``calib.beyond``).

The paper's lookup (method.md §2.1) gives a row longer than every calibrated row the θ of the longest one: the
``clamp`` rule, and the default. But θ moves with the row length n: the (k+1)-th largest of n scores grows with n
before the softmax, and the (k+1)-th largest probability shrinks roughly like 1/n after it. A clamped θ therefore
keeps more and more of a row as n grows past the calibration lengths (issue 30: on passkey at 8k, 5-7× what Top-k
keeps at the same k).

The ``fit`` rule fits, per (layer, head), a law of θ against n on the calibrated lengths and extrapolates it:

* ``log``:   θ = a + b·log n (either placement);
* ``power``: log θ = a + b·log n, i.e. θ = e^a·n^b (post-softmax only: θ is a probability, > 0);
* ``flat``:  θ = θ(n_max), the clamp, kept as a candidate so a (layer, head) whose θ does not trend keeps it.

The fit uses the calibrated lengths in the upper half of the calibrated range on a log scale (the lengths nearest
to where the law is used; short rows, just above k, follow the order statistic's small-n regime). Each candidate is
fitted without the longest quarter of those lengths and scored by its weighted squared error on them (weights: the
calibration samples behind each θ; units: θ before the softmax, log θ after it), which is the extrapolation the law
is for; the winner, ties going to the simpler law, is refitted on all of them. Too few lengths (< 3), or a fit that
is not finite, leave the clamp. Every θ past the calibrated lengths is then finite, and after the softmax inside
[tiny, 1] (the clamp's too: a calibrated θ of 0 becomes tiny); a (layer, head) never calibrated keeps θ = −inf
(it never drops), whatever the rule.

``Thresholds.lookup`` applies the law to rows with n > n_max only; rows up to n_max use the table as before, and
rows past n_max are still counted in ``clamped_rows`` (rows beyond the calibrated lengths, under either rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RULES = ("clamp", "fit")
LAWS = ("flat", "log", "power")  # codes 0, 1, 2 in BeyondLaw.law
MIN_LENGTHS = 3  # calibrated lengths a law needs (two to fit, one to hold out)
HOLD_OUT = 0.25  # the longest quarter of the fitted lengths scores each candidate
TINY = torch.finfo(torch.float32).tiny


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"beyond must be one of {RULES} (rows longer than any calibrated row: clamp uses the θ of "
                         f"the longest, fit extrapolates a law of θ against n), got {rule!r}")
    return rule


@dataclass
class BeyondLaw:
    """Per (layer, head): which law (``law`` codes into LAWS) and its coefficients."""

    law: torch.Tensor  # (L, H|1) int64, -1 where nothing was calibrated
    a: torch.Tensor  # (L, H|1) float64
    b: torch.Tensor  # (L, H|1) float64
    placement: str

    def apply(self, layer: int, n: torch.Tensor, theta: torch.Tensor, max_n: int) -> torch.Tensor:
        """``theta`` (B, H|1, Q), the table's θ for rows of lengths n (B, 1, Q), with the rows past ``max_n`` of every
        calibrated (layer, head) given the law's θ (flat: the table's, clipped to the placement's range). No host
        read: a device-side select."""
        law, a, b = (t[layer].to(n.device)[None, :, None] for t in (self.law, self.a, self.b))  # (1, H|1, 1)
        y = a + b * n.double().clamp_min(1).log()  # (B, H|1, Q) float64
        fitted = torch.where(law == 2, y.clamp(max=0.0).exp(), y)
        fitted = clip(torch.where(law == 0, theta.double(), fitted), self.placement).to(theta.dtype)
        return torch.where((n > max_n) & (law >= 0), fitted, theta)


def clip(theta: torch.Tensor, placement: str) -> torch.Tensor:
    """θ inside what the placement allows: finite logits before the softmax, probabilities in [tiny, 1] after it."""
    theta = torch.nan_to_num(theta, nan=0.0, posinf=1.0e30, neginf=-1.0e30)
    if placement == "post":
        return theta.clamp(TINY, 1.0)
    return theta.clamp(-1.0e30, 1.0e30)


def fit(values: torch.Tensor, placement: str, counts: torch.Tensor | None = None) -> BeyondLaw:
    """The law of each (layer, head) from calibrated ``values`` (L, H|1, N) indexed by n, NaN where uncalibrated;
    ``counts`` (same shape) weight the lengths."""
    L, H, N = values.shape
    law = torch.full((L, H), -1, dtype=torch.long)  # -1: never calibrated (θ = −inf, never drops), left alone
    a, b = torch.zeros(L, H, dtype=torch.float64), torch.zeros(L, H, dtype=torch.float64)
    for layer in range(L):
        for head in range(H):
            row = values[layer, head].double()
            known = (~torch.isnan(row)).nonzero().flatten()
            if known.numel() == 0:
                continue
            weights = counts[layer, head, known].double().clamp_min(1) if counts is not None else None
            law[layer, head], a[layer, head], b[layer, head] = choose(known.double(), row[known], placement, weights)
    return BeyondLaw(law, a, b, placement)


def choose(n: torch.Tensor, theta: torch.Tensor, placement: str,
           weights: torch.Tensor | None = None) -> tuple[int, float, float]:
    """(law code, a, b) for one (layer, head) from its calibrated lengths n (ascending) and θ (float64)."""
    weights = torch.ones_like(n) if weights is None else weights
    window = n >= math.sqrt(float(n[0]) * float(n[-1]))  # the upper half of the range, in log n
    if int(window.sum()) < MIN_LENGTHS:
        window = torch.arange(len(n)) >= len(n) - MIN_LENGTHS  # the last few, when the upper half has too few
    n, theta, weights = n[window], theta[window], weights[window]
    if len(n) < MIN_LENGTHS:
        return 0, 0.0, 0.0
    x = n.log()
    unit = _unit(theta, placement)  # where errors are measured
    held = max(1, int(len(n) * HOLD_OUT))
    train = slice(0, len(n) - held)
    candidates = ("flat", "log") if placement == "pre" else ("flat", "log", "power")
    best, best_error = "flat", math.inf
    for name in candidates:
        coef = _fit(name, x[train], theta[train], weights[train])
        if coef is None:
            continue
        predicted = _predict(name, coef, x[-held:], theta[train][-1], placement)
        residual = _unit(predicted, placement) - unit[-held:]
        error = float((weights[-held:] * residual ** 2).sum() / weights[-held:].sum())
        if best_error == math.inf or error < best_error - 1e-9 * max(1.0, best_error):  # ties: the simpler law
            best, best_error = name, error
    coef = _fit(best, x, theta, weights) if best != "flat" else None
    if coef is None:
        return 0, 0.0, 0.0
    return LAWS.index(best), coef[0], coef[1]


def _fit(name: str, x: torch.Tensor, theta: torch.Tensor, weights: torch.Tensor) -> tuple[float, float] | None:
    """Weighted least squares (a, b) of the law's y on x = log n ((0, 0) for flat); None where it is not finite."""
    if name == "flat":
        return (0.0, 0.0)
    y = theta if name == "log" else theta.clamp_min(TINY).log()
    w = weights / weights.sum()
    mx, my = float((w * x).sum()), float((w * y).sum())
    var = float((w * (x - mx) ** 2).sum())
    if var <= 0:
        return None
    slope = float((w * (x - mx) * (y - my)).sum()) / var
    intercept = my - slope * mx
    return (intercept, slope) if math.isfinite(slope) and math.isfinite(intercept) else None


def _predict(name: str, coef: tuple[float, float], x: torch.Tensor, flat: torch.Tensor, placement: str) -> torch.Tensor:
    if name == "flat":
        return flat.expand_as(x)
    y = coef[0] + coef[1] * x
    return clip(y.clamp(max=0.0).exp() if name == "power" else y, placement)


def _unit(theta: torch.Tensor, placement: str) -> torch.Tensor:
    """θ in the units errors are measured in: logits before the softmax, log-probabilities after it."""
    return theta if placement == "pre" else theta.clamp_min(TINY).log()
