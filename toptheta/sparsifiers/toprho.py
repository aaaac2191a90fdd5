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

``head_weights`` (``sparsifier.head_weights``, one list per layer of one weight per query head) gives each head its
own share, ρ·w (at most 1): ``scripts/head_budget.py`` takes the weights from the shares another run's heads kept
(``results/analysis/kept_by_row.csv``), so Top-ρ can spend a budget over the heads as that run did while the fit
of ρ still matches the total.
"""

from __future__ import annotations

import math

import torch

from ..registry import Parameter, register_sparsifier
from .base import ParameterRule, RowBlock, keep_whole_short_rows

# sparsifier.target_kept searches ρ over [1e-3, 1]: a larger share keeps more keys. It starts at ρ = the target, as
# the rows kept whole (n ≤ k) and the ceiling only add a little, with d log(kept)/dρ = 1/ρ: two steps, not six.
RHO = Parameter("rho", 1e-3, 1.0, log=False, keeps_more_when_higher=True,
                valid="a share of each row's keys in (0, 1], e.g. sparsifier.rho=0.1",
                guess=lambda target: (target, 1 / target))


@register_sparsifier("toprho", label="Top-ρ", parameter=RHO, options=("head_weights",))
class TopRho(ParameterRule):
    """Per-row, per-head top-⌈ρ·n⌉ selection.

    Args:
        rho: the share of each row's valid keys it keeps, in (0, 1]; ρ = 1 keeps every key (dense).
        placement: ``"pre"`` or ``"post"`` (softmax): the same kept set, normalised as in Top-k.
        k: rows with at most k valid keys are kept whole (None: every row is sparsified).
        layer_k: per-layer overrides of ``k``, e.g. ``{0: 512, 1: 512}``.
        head_weights: None (every head keeps ρ) or, per layer, one positive weight per query head: head h of layer l
            keeps a share min(1, ρ·w[l][h]) of each row.
    """

    parameter = RHO
    rho: float

    def __init__(self, rho: float, placement: str = "post", k: int | None = None,
                 layer_k: dict[int, int] | None = None, head_weights=None):
        super().__init__(rho, placement, k, layer_k)
        self.head_weights = check_head_weights(head_weights)
        self._shares: dict[tuple[int, str], torch.Tensor] = {}  # (layer, device) -> (1, H, 1) float64

    @classmethod
    def from_config(cls, settings: dict, thresholds=None) -> "TopRho":
        return cls(settings["rho"], settings["placement"], settings.get("k"), settings.get("layer_k"),
                   settings.get("head_weights"))

    def shares(self, layer: int, heads: int, device: torch.device | str = "cpu") -> float | torch.Tensor:
        """ρ, or with head_weights the (1, H, 1) float64 shares of the layer's heads, min(1, ρ·w) (made once per
        layer and device: no copy inside a layer call after the first)."""
        if self.head_weights is None:
            return self.rho
        if not 0 <= layer < len(self.head_weights):
            raise ValueError(f"sparsifier.head_weights has {len(self.head_weights)} layers; layer {layer} has none: "
                             "take them from a run of this model (scripts/head_budget.py)")
        weights = self.head_weights[layer]
        if len(weights) != heads:
            raise ValueError(f"sparsifier.head_weights gives layer {layer} {len(weights)} weights, but its attention "
                             f"has {heads} query heads: take them from a run of this model (scripts/head_budget.py)")
        key = (layer, str(device))
        if key not in self._shares:
            self._shares[key] = torch.tensor([min(1.0, self.rho * w) for w in weights], dtype=torch.float64,
                                             device=device).view(1, heads, 1)
        return self._shares[key]

    def select(self, rows: RowBlock) -> torch.Tensor | None:
        k = self.k_for(rows.layer)
        if rows.logits.shape[-1] <= k:  # every row has n ≤ K ≤ k: nothing to drop
            return None
        rho = self.shares(rows.layer, rows.logits.shape[1], rows.logits.device)  # (checks head_weights' shape)
        if self._keeps_all(rows.layer):  # every head's share is 1
            return None
        boundary = kept_boundary(rows.logits, rows.n, rho)  # (B, H, Q, 1)
        keep = (rows.logits >= boundary) & rows.valid  # ties with the m-th kept; rows without keys keep none
        return keep_whole_short_rows(keep, rows, k)

    def _keeps_all(self, layer: int) -> bool:
        """Whether every head of the layer keeps a share of 1 (nothing to drop)."""
        if self.head_weights is None:
            return self.rho >= 1.0
        return min(self.head_weights[layer]) * self.rho >= 1.0

    @classmethod
    def check_options(cls, options: dict) -> None:
        check_head_weights(options.get("head_weights"))

    @classmethod
    def check_model(cls, settings: dict, num_layers: int, num_heads: int | None, model_name: str) -> None:
        weights = settings.get("head_weights")
        shape = [len(row) for row in weights] if weights is not None else None
        if shape is not None and (len(shape) != num_layers or (num_heads is not None and set(shape) != {num_heads})):
            raise ValueError(f"sparsifier.head_weights has {len(shape)} layer(s) of {sorted(set(shape))} weights, "
                             f"but {model_name} has {num_layers} layers of {num_heads} query heads: take the weights "
                             "from a run of this model (scripts/head_budget.py)")

    def describe(self) -> dict:
        return {**super().describe(), **({"head_weights": self.head_weights} if self.head_weights else {})}

    def __repr__(self) -> str:
        if self.head_weights is None:
            return super().__repr__()
        shape = f"{len(self.head_weights)}×{len(self.head_weights[0])}"
        return super().__repr__()[:-1] + f", head_weights=<{shape} weights>)"


def check_head_weights(head_weights) -> list[list[float]] | None:
    """None, or one non-empty list per layer of positive finite weights (floats); a clear error otherwise."""
    if head_weights is None:
        return None
    rows = [list(row) for row in head_weights if _is_list(row)] if _is_list(head_weights) else []
    if not rows or len(rows) != len(head_weights) or not all(row and all(map(_is_weight, row)) for row in rows):
        raise ValueError(f"sparsifier.head_weights must be one list per layer of positive weights, one per query "
                         f"head (e.g. [[1.0, 2.0], [0.5, 0.5]]), or null; got {head_weights!r}")
    return [[float(w) for w in row] for row in rows]


def _is_list(value) -> bool:
    """A list, tuple or OmegaConf ListConfig (not a string or a mapping)."""
    return hasattr(value, "__len__") and hasattr(value, "__iter__") and not isinstance(value, (str, bytes)) \
        and not hasattr(value, "keys")


def _is_weight(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def kept_count(n: torch.Tensor, rho: float | torch.Tensor) -> torch.Tensor:
    """m = ⌈ρ·n⌉, at least 1 (int64; n's shape, broadcast with a tensor ρ): the keys a row of n valid keys keeps
    (ties aside)."""
    n = n.double()
    return (n * rho - 1e-9 * n).ceil().clamp_min(1).long()


def kept_boundary(logits: torch.Tensor, n: torch.Tensor, rho: float | torch.Tensor) -> torch.Tensor:
    """(B, H, Q, 1) each row's ⌈ρ·n⌉-th largest logit: the row keeps the scores at or above it.

    ``logits`` (B, H, Q, K) with −inf at invalid keys (they sort last), ``n`` (B, 1, Q) the valid keys per row,
    ``rho`` one share or (1, H, 1) shares per head.
    One sorted top-m call as wide as the chunk's widest m (on the CPU, where reading that width is free; elsewhere
    the whole row, so no layer call waits on the host), then each row's own m-th value."""
    m = kept_count(n, rho).clamp_max(logits.shape[-1])  # (B, 1, Q), or (B, H, Q) with shares per head
    width = int(m.max()) if logits.device.type == "cpu" else logits.shape[-1]
    ranked = torch.topk(logits, width, dim=-1).values  # (B, H, Q, width), sorted descending
    index = (m - 1).unsqueeze(-1).expand(*logits.shape[:3], 1)  # (B, H, Q, 1)
    return ranked.gather(-1, index)
