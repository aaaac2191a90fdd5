"""What a sparsifier is: a rule that says which elements of each attention row survive.

A sparsifier sees one chunk of rows at a time (see ``toptheta.attention.kernel``) and returns a
boolean keep-mask. It never touches the softmax or the values: compensation and the output are the
kernel's job, so a new selection rule is one small class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..registry import PLACEMENTS, Parameter, name_of


class RowBlock:
    """One chunk of attention rows of one layer, as the kernel sees it.

    Shapes use B (batch), H (query heads), Q (rows in the chunk), K (keys in the chunk window).
    Everything is float32 whatever the model dtype. A row's length n counts its valid keys: causal,
    not padding, inside any sliding window (method.md §2.1).

    The kernel fills in what its path computed anyway (the probabilities on the dense/post-softmax
    path, exp(s − m) on the pre-softmax path); everything else is derived from the logits on first
    use, so selection rules and observers can read any view without the hot path paying for it.
    """

    def __init__(self, layer: int, phase: str, logits: torch.Tensor, n: torch.Tensor, *,
                 valid: torch.Tensor | Callable[[], torch.Tensor] | None = None,
                 probs: torch.Tensor | None = None, exp_scores: torch.Tensor | None = None,
                 row_sum: torch.Tensor | None = None, row_max: torch.Tensor | None = None):
        self.layer = layer
        self.phase = phase  # "prefill" (a prompt or scoring pass) or "decode" (a generation step after the prompt)
        self.logits = logits  # (B, H, Q, K) scaled scores, -inf where invalid
        self.n = n  # (B, 1, Q) number of valid keys of each row
        self.keep: torch.Tensor | None = None  # (B, H, Q, K) bool once a sparsifier has chosen (None = all)
        self.theta: torch.Tensor | None = None  # (B, H, Q, 1) per-row threshold, set by threshold sparsifiers
        self.clamped_rows = 0  # rows longer than any calibrated row length (threshold lookups clamp)
        self.empty: torch.Tensor | None = None  # (B, H, Q) bool: sparsified rows where no valid score passes θ
        self.kept_counts: torch.Tensor | None = None  # (B, H, Q) kept keys per row, when the sparsifier knows
        self.vrow_counts: torch.Tensor | None = None  # (B, Hkv) decode: kept V rows (union over each group)
        self.kept_mass: torch.Tensor | None = None  # (B, H, Q, 1) dense probability mass kept, set by the kernel
        # An observer that reads each row's (k + 1)-th largest score (calibration's τ) sets want_next (through the
        # kernel, from its ``wants_next_index``); an exact top-k selection then finds it on the way: next_index.
        self.want_next = False
        self.next_index: torch.Tensor | None = None  # (B, H, Q, 1) index of each row's (k + 1)-th largest logit
        self._valid = valid
        self._probs, self._exp_scores, self._row_sum, self._row_max = probs, exp_scores, row_sum, row_max
        self._max_prob: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """(B, 1, Q, K) bool: the keys each row may attend to (built on first use for causal chunks)."""
        if callable(self._valid):
            self._valid = self._valid()
        return self._valid

    @property
    def row_max(self) -> torch.Tensor:
        """(B, H, Q, 1) max valid logit, 0 for rows with no valid key."""
        if self._row_max is None:
            m = self.logits.amax(-1, keepdim=True)
            self._row_max = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        return self._row_max

    @property
    def exp_scores(self) -> torch.Tensor:
        """(B, H, Q, K) exp(logits − row_max), 0 where invalid."""
        if self._exp_scores is None:
            self._exp_scores = torch.sub(self.logits, self.row_max).exp_()
        return self._exp_scores

    @property
    def row_sum(self) -> torch.Tensor:
        """(B, H, Q, 1) Σ exp_scores: the dense softmax denominator."""
        if self._row_sum is None:
            self._row_sum = self.exp_scores.sum(-1, keepdim=True)
        return self._row_sum

    @property
    def probs(self) -> torch.Tensor:
        """Dense softmax probabilities (B, H, Q, K), 0 where invalid."""
        if self._probs is None:
            self._probs = self.exp_scores / self.row_sum.clamp_min(torch.finfo(torch.float32).tiny)
        return self._probs

    def scores(self, placement: str) -> torch.Tensor:
        """The values a placement selects on: scaled logits (pre) or probabilities (post)."""
        return self.logits if placement == "pre" else self.probs

    def max_score(self, placement: str) -> torch.Tensor:
        """(B, H, Q, 1) each row's largest score in the placement's units (0 for rows with no valid key)."""
        if placement == "pre":
            return self.row_max
        if self._max_prob is None:
            self._max_prob = self.probs.amax(-1, keepdim=True)
        return self._max_prob

    def counts(self) -> torch.Tensor:
        """(B, H, Q) kept keys per row (n where nothing was dropped)."""
        if self.kept_counts is None:
            B, H, Q = self.logits.shape[:3]
            if self.keep is None:
                self.kept_counts = self.n.expand(B, H, Q)
            else:
                self.kept_counts = self.keep.sum(-1)
        return self.kept_counts

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


@dataclass
class FusedRule:
    """A selection the fused post-softmax kernel (``attention/fused.py``) makes in its one pass over a row.

    Exactly one of ``theta``, ``k``, ``p`` and ``cut`` is set. ``theta`` (B, H, Q), probability units: keep p > θ
    and each row's maximum. ``k``: keep each row's k largest logits (ties at the k-th value broken by key order).
    ``p``: keep each row's nucleus, the fewest largest logits holding a fraction p of its probability, with the keys
    tied with the last one (top-p). ``cut`` (B, H, Q), logits: keep s ≥ cut (skip-softmax; never above the row's
    maximum). Rows marked in ``whole`` (B, H, Q) bool keep every valid key. ``empty`` (B, H, Q) bool, optional: the
    rows the rule counts as empty (``RowBlock.empty``) where the kernel cannot tell.
    """

    whole: torch.Tensor
    theta: torch.Tensor | None = None
    k: int | None = None
    p: float | None = None
    cut: torch.Tensor | None = None
    empty: torch.Tensor | None = None

    def __post_init__(self):
        if sum(rule is not None for rule in (self.theta, self.k, self.p, self.cut)) != 1:
            raise ValueError("a FusedRule sets exactly one of theta, k, p and cut")


class Sparsifier:
    """Base class. Subclasses set ``placement`` and implement :meth:`select`."""

    placement: str | None = None  # None for dense

    def k_for(self, layer: int) -> int | None:
        """Budget of a layer: rows with at most this many valid keys are kept whole (None = dense)."""
        return None

    def select(self, rows: RowBlock) -> torch.Tensor | None:
        """Keep-mask (B, H, Q, K), a subset of ``rows.valid``; None means keep every valid key."""
        raise NotImplementedError

    def fused_rule(self, rows: RowBlock) -> FusedRule | None:
        """The rule in a form the fused post-softmax kernel applies itself (``select`` must mean the same), or
        None: use ``select``. Post-softmax threshold and top-k rules offer it."""
        return None

    def fused_whole(self, rows: RowBlock) -> torch.Tensor | None:
        """For a rule with a budget k (Top-k, top-p, skip-softmax): the rows it keeps whole (B, H, Q), those with at
        most k valid keys, when the fused kernel can take the chunk; None when the plain kernel must. Pre-softmax
        weights are renormalised over the kept set (the plain kernel's job), and a chunk whose rows all fit in k
        keys is dense there, as in ``select``."""
        k = self.k_for(rows.layer)
        if self.placement != "post" or k is None or rows.logits.shape[-1] <= k:
            return None
        return (rows.n <= k).expand(rows.logits.shape[:3])

    def describe(self) -> dict:
        return {"name": type(self).__name__.lower(), "placement": self.placement}

    @classmethod
    def check_options(cls, options: dict) -> None:
        """Raise ValueError, naming the fix, for a value of its own options (``register_sparsifier(options=...)``;
        ``options`` maps each to its configured value, None when unset, and ``target_kept`` to the matched-sparsity
        target, None without) that the config's types do not rule out.
        Called when a config is checked, before anything loads."""

    @classmethod
    def check_model(cls, settings: dict, num_layers: int, num_heads: int | None, model_name: str) -> None:
        """Raise ValueError, naming the fix, for settings that do not fit the model (its depth and query heads).
        Called once the model is known, before it evaluates."""


class ParameterRule(Sparsifier):
    """A rule with one parameter of its own instead of a budget (top-p's p, skip-softmax's λ, Top-ρ's ρ).

    Subclasses set ``parameter`` (the registry.Parameter they register with: its key names the attribute, the
    config field and the keyword) and implement :meth:`select`. ``k`` and ``layer_k`` only keep short rows whole, as
    Top-k's budget does (method.md §1), so ``layer_k={0: 512, 1: 512}`` leaves the same rows dense as the paper's runs.
    """

    parameter: Parameter

    def __init__(self, value: float, placement: str, k: int | None = None, layer_k: dict[int, int] | None = None):
        name, key = type(self).__name__, self.parameter.key
        if not self.parameter.accepts(value):
            raise ValueError(f"{name} needs {key}: {self.parameter.valid}; got {value!r}")
        setattr(self, key, float(value))
        self.placement = check_placement(placement)
        self.k, self.layer_k = check_budgets(name, k, layer_k)

    @classmethod
    def from_config(cls, settings: dict, thresholds=None) -> "ParameterRule":
        return cls(settings[cls.parameter.key], settings["placement"], settings.get("k"), settings.get("layer_k"))

    @property
    def value(self) -> float:
        """The parameter's value (``self.p``, ``self.lam``, ``self.rho``)."""
        return getattr(self, self.parameter.key)

    def k_for(self, layer: int) -> int:
        return self.layer_k.get(layer, self.k or 0)

    def describe(self) -> dict:
        return {"name": name_of(self), "placement": self.placement, self.parameter.key: self.value, "k": self.k,
                "layer_k": dict(self.layer_k)}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.parameter.key}={self.value:.12g}, placement={self.placement!r}, k={self.k}, "
                f"layer_k={self.layer_k})")


def check_placement(placement: str) -> str:
    aliases = {"pre-softmax": "pre", "post-softmax": "post"}
    placement = aliases.get(placement, placement)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be 'pre' or 'post' (softmax), got {placement!r}")
    return placement


def check_budgets(name: str, k, layer_k) -> tuple[int | None, dict[int, int]]:
    """(k, layer_k) of a rule without a budget of its own (top-p, skip-softmax), checked: only the rows it keeps
    whole, as Top-k's budget does (method.md §1); k None sparsifies every row."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"{name}'s k (rows with at most k keys are kept whole) must be None or an integer ≥ 1, got {k!r}")
    layer_k = {int(layer): int(v) for layer, v in (layer_k or {}).items()}
    if any(v < 1 for v in layer_k.values()):
        raise ValueError(f"every layer_k value must be ≥ 1, got {layer_k}")
    return k, layer_k


def keep_whole_short_rows(keep: torch.Tensor, rows: RowBlock, k: int, also: torch.Tensor | None = None) -> torch.Tensor:
    """Rows with n ≤ k are not sparsified (method.md §1): they keep every valid key.

    ``also`` (broadcastable to (B, H, Q, 1)) marks more rows to keep whole. Chunks with no such row
    (every chunk of a long prefill but the first) skip the pass over the keys.
    """
    whole = (rows.n <= k).unsqueeze(-1)  # (B, 1, Q, 1)
    if also is not None:
        whole = whole | also
    if whole.device.type == "cpu" and not bool(whole.any()):  # (a host read elsewhere: there, always the where)
        return keep
    return torch.where(whole, rows.valid, keep)
