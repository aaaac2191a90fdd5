"""One attention call, lowered once: what every backend reads instead of the sparsifier and compensation objects.

``kernel.sparse_attention`` builds an :class:`AttentionCall` per layer call and hands it to the registry
(``backends/__init__.py``). The translation of a sparsifier and its compensations into kernel inputs happens here,
in one place, for every backend (method.md §2-3):

* ``kind``: the name the sparsifier's class is registered under (toptheta/registry.py: "dense", "topk", "toptheta",
  "topp", ...), or "other" for an unregistered class or a subclass; backends serve the kinds they know by name, and
  the plain kernel's ``select`` serves every kind;
* ``placement``, ``empty_rows`` (Top-θ's rule for rows where nothing passes θ);
* ``sdc_mode`` (0 none, 1 exact, 2 exp-threshold, 3 calibrated; pre-softmax Top-θ/Top-k only), ``sdc_scale`` λ;
* ``vmc``: whether β·v̄ is added (only where something can be dropped);
* :meth:`thetas`: the per-row θ a kernel compares with (rows kept whole get ``KEEP_ALL``), θ as calibrated (for
  exp-threshold SDC) and the clamped-row count; :meth:`sdc_mass`: calibrated SDC's dropped mass per row.

Shapes: query (B, H, Q, D); key, value (B, Hkv, K, D|Dv), GQA unexpanded; valid (B|1, 1, Q, K) bool or None
(causal, the queries being the last Q keys).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from ...compensation import SDC, lower, lowering
from ...registry import name_of
from ...sparsifiers import TopTheta
from ...sparsifiers.base import Sparsifier

SDC_MODES = lowering.SDC_MODES
KEEP_ALL = -1.0e29  # θ that keeps every valid key (the C++ kernels' "no key" sentinel is −1e30)


@dataclass
class AttentionCall:
    """The arguments of one ``sparse_attention`` call plus their lowering (see the module docstring)."""

    query: torch.Tensor  # (B, H, Q, D)
    key: torch.Tensor  # (B, Hkv, K, D)
    value: torch.Tensor  # (B, Hkv, K, Dv)
    valid: torch.Tensor | None  # (B|1, 1, Q, K) bool; None = causal, queries at the last Q keys
    scaling: float
    layer: int
    sparsifier: Sparsifier
    compensations: tuple = ()
    stats: object = None
    observer: Callable | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    bias: torch.Tensor | None = None  # (B|1, 1|H, Q, K) additive float
    phase: str = "prefill"
    forced: bool = False  # TOPTHETA_BACKEND named the backend that gets this call
    # lowered once in __post_init__
    kind: str = field(init=False)
    placement: str | None = field(init=False)
    empty_rows: str = field(init=False)
    sdc: SDC | None = field(init=False)
    sdc_mode: int = field(init=False)
    sdc_scale: float = field(init=False)
    lowered: lowering.KernelCompensation = field(init=False)
    vmc: bool = field(init=False)

    def __post_init__(self):
        self.compensations = tuple(self.compensations or ())
        self.kind = name_of(self.sparsifier)
        self.placement = self.sparsifier.placement
        self.empty_rows = getattr(self.sparsifier, "empty_rows", "keep-max")
        self.lowered = lower(self.compensations, self.placement)  # each compensation says what it asks of a kernel
        self.sdc, self.vmc = self.lowered.sdc, self.lowered.vmc
        self.sdc_mode, self.sdc_scale = self.lowered.sdc_mode, self.lowered.sdc_scale

    # --- shapes and places -------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """(B, H, Hkv, Q, K)."""
        B, H, Q, _ = self.query.shape
        return B, H, self.key.shape[1], Q, self.key.shape[2]

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def on_cpu(self) -> bool:
        """Every tensor of the call is a CPU tensor (what a CPU kernel may be handed)."""
        tensors = [self.query, self.key, self.value, self.valid, self.bias]
        return all(t.device.type == "cpu" for t in tensors if t is not None)

    @property
    def counting(self) -> bool:
        return self.stats is not None and self.stats.enabled

    @property
    def is_decode_row(self) -> bool:
        """One query row of a decode step: the decode backends' calls."""
        return self.query.shape[2] == 1 and self.phase == "decode"

    # --- lowering of the sparsifier: per-row θ and calibrated SDC mass --------------------------------
    def thetas(self, n: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(θ the kernel compares with, θ as calibrated, rows clamped) for rows of lengths n (B, 1, Q): (B, H, Q) each,
        float32 contiguous. Rows kept whole (n ≤ k, or θ = −inf where uncalibrated) get KEEP_ALL. ``causal``: the
        lengths depend only on (B, Q, K), so the lookup is memoised per sparsifier."""
        B, H, Hkv, Q, K = self.shape
        return row_thresholds(self.sparsifier, self.layer, n, H, memo_k=K if causal else None)

    def sdc_mass(self, n: torch.Tensor) -> torch.Tensor:
        """Calibrated SDC's dropped mass per row (B, H|1, Q) float32 (only with ``sdc_mode == 3``)."""
        return self.lowered.calibrated_mass(self.layer, n, self.sparsifier)


def row_thresholds(sparsifier: TopTheta, layer: int, n: torch.Tensor, H: int, memo_k: int | None = None):
    """See :meth:`AttentionCall.thetas`; n (B, 1, Q). ``memo_k``: K of a causal call (its lengths are fixed by
    (B, Q, K)): on short prompts the lookup and its small tensor ops cost as much as the attention itself."""
    B, _, Q = n.shape
    if memo_k is not None and Q == 1:  # a causal decode row: every sequence's row has memo_k valid keys
        return _uniform_row_thresholds(sparsifier, layer, memo_k, B, H, n.device)
    key = (layer, B, Q, memo_k, n.device, H)
    memo = _THETAS.setdefault(sparsifier, {}) if memo_k is not None else {}
    if key not in memo:
        raw, clamped = sparsifier.thresholds.lookup(layer, n)  # (B, H|1, Q)
        theta_raw = raw.expand(B, H, Q)
        whole = (n <= sparsifier.k_for(layer)) | (theta_raw < KEEP_ALL)  # short rows, uncalibrated θ = −inf
        finite = theta_raw.clamp(KEEP_ALL, 1.0e30)
        if len(memo) > 256:  # lm-eval scores many lengths: keep the memo small
            memo.clear()
        memo[key] = (torch.where(whole, KEEP_ALL, finite).contiguous(), finite.contiguous(), clamped)
    return memo[key]


_THETAS: "weakref.WeakKeyDictionary[TopTheta, dict]" = weakref.WeakKeyDictionary()
_BLOCK = 256  # row lengths per block of _uniform_row_thresholds' tables


def _uniform_row_thresholds(sparsifier: TopTheta, layer: int, length: int, B: int, H: int, device):
    """:func:`row_thresholds` for B rows of ``length`` valid keys each (a decode step without padding), read from a
    per-layer table of every length (blocks of _BLOCK lengths, built on first use by :func:`row_thresholds` itself,
    so the numbers are its own): a step costs a view, not the dozen small ops of a lookup (each decode step has a
    new length, so the memo above never hits there)."""
    thresholds = sparsifier.thresholds
    last = thresholds.table("values", device).shape[-1] - 1
    top = max(last, sparsifier.k_for(layer)) + 1  # every length from here on gets the same θ
    i = min(length, top)
    blocks = _DECODE_THETAS.setdefault(sparsifier, {})
    key = (layer, H, device, i // _BLOCK)
    if key not in blocks:
        n = torch.arange(i - i % _BLOCK, i - i % _BLOCK + _BLOCK, device=device).view(1, 1, _BLOCK)
        theta, raw, _ = row_thresholds(sparsifier, layer, n, H)  # (1, H, _BLOCK) each
        blocks[key] = (theta[0].t().contiguous(), raw[0].t().contiguous())  # (_BLOCK, H): a length's θ contiguous
    theta, raw = (t[i % _BLOCK].view(1, H, 1) for t in blocks[key])
    if B > 1:
        theta, raw = theta.expand(B, H, 1).contiguous(), raw.expand(B, H, 1).contiguous()
    clamped = B if last > 0 and length > thresholds._max_n else 0  # as Thresholds.lookup counts them
    return theta, raw, clamped


_DECODE_THETAS: "weakref.WeakKeyDictionary[TopTheta, dict]" = weakref.WeakKeyDictionary()


def forced_backend() -> str | None:
    """The backend ``TOPTHETA_BACKEND`` names (None or "auto": the registry chooses)."""
    name = os.environ.get("TOPTHETA_BACKEND", "").strip()
    return None if name in ("", "auto") else name
