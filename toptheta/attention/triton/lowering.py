"""From the project's objects to the kernels' plain tensors, and back to the statistics (torch only).

The kernels take per-row tensors (``theta``, ``sdc_mass``); these helpers build them from a ``TopTheta``
sparsifier exactly as ``TopTheta.select`` decides (rows with n ≤ k, and uncalibrated rows, are kept whole:
θ = −inf), and feed a kernel's per-row counts to ``SparsityStats`` through the same ``RowBlock`` fields the
C++ fast paths fill, so the statistics are the plain kernel's.
"""

from __future__ import annotations

import torch

from ...sparsifiers.base import RowBlock
from ...sparsifiers.topk import TopK
from ...sparsifiers.topp import TopP, nucleus_boundary
from .common import TritonAttention


def row_thresholds(sparsifier, layer: int, n: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(θ (B, H|1, Q) float32 for the kernels, rows clamped at the calibrated maximum) for rows of lengths n (B, Q)."""
    theta, clamped = sparsifier.thresholds.lookup(layer, n[:, None, :].long())  # (B, H|1, Q)
    whole = (n <= sparsifier.k_for(layer))[:, None, :]  # (B, 1, Q) short rows: not sparsified (method.md §1)
    return torch.where(whole, float("-inf"), theta.float()).contiguous(), clamped


def topk_boundary(k: int):
    """The decode kernel's ``boundary`` for Top-k: each row keeps its k largest logits, ties at the k-th broken by
    key order (the fused CPU kernel's rule, ``FusedRule``); rows of n ≤ k keep every valid key (θ = −inf).

    θ is the k-th logit (``torch.topk``); ``last`` the index of the tied key that completes k, from a count of
    the logits above θ and a running count of those at θ: ten device ops, no host read."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"Top-k needs an integer k ≥ 1, got {k!r}")

    def boundary(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, H, Q, K) -> (B, H, Q) × 2
        K = logits.shape[-1]
        if k >= K:  # every row has n ≤ k: all kept
            return logits.new_full(logits.shape[:-1], float("-inf")), logits.new_full(logits.shape[:-1], K,
                                                                                     dtype=torch.int32)
        theta = logits.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # the k-th logit
        need = k - (logits > theta).sum(-1, dtype=torch.int32)  # ≥ 1 keys tied with θ still to keep
        ties = (logits == theta).cumsum(-1, dtype=torch.int32)  # running count of the logits at θ
        return theta.squeeze(-1), (ties < need[..., None]).sum(-1, dtype=torch.int32)  # the need-th tie's index

    return boundary


def topp_boundary(p: float, k: int = 0):
    """The decode kernel's ``boundary`` for top-p: each row keeps the keys scoring at least the last one its mass p
    needs, ties with it kept (``topp.nucleus_boundary``, the plain kernel's rule); rows of n ≤ k keep every valid
    key."""
    def boundary(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, H, Q, K) -> (B, H, Q) × 2
        K = logits.shape[-1]
        keep_all = logits.new_full(logits.shape[:-1], K, dtype=torch.int32)  # every tie with θ kept
        if K <= k or p >= 1.0:  # nothing to drop
            return logits.new_full(logits.shape[:-1], float("-inf")), keep_all
        m = logits.amax(-1, keepdim=True)
        theta = nucleus_boundary(logits, torch.where(torch.isfinite(m), m, 0.0), p).squeeze(-1)
        whole = torch.isfinite(logits).sum(-1) <= k  # short rows: not sparsified (method.md §1)
        return theta.masked_fill(whole, float("-inf")), keep_all

    return boundary


def row_boundary(sparsifier, layer: int):
    """The decode kernel's ``boundary`` for a Top-k or top-p sparsifier in ``layer``."""
    if isinstance(sparsifier, TopK):
        return topk_boundary(sparsifier.k_for(layer))
    if isinstance(sparsifier, TopP):
        return topp_boundary(sparsifier.p, sparsifier.k_for(layer))
    raise ValueError(f"no boundary rule for {type(sparsifier).__name__}: Top-k and top-p rank whole rows")


def calibrated_mass(source, layer: int, n: torch.Tensor) -> torch.Tensor:
    """Calibrated SDC's mean dropped mass E (B, H|1, Q) for rows of lengths n (B, Q); ``source``: Thresholds."""
    return source.lookup_sdc(layer, n[:, None, :].long()).float()


def record(stats, result: TritonAttention, *, layer: int, phase: str, key_len: int, sparse: bool = True,
           clamped_rows: int = 0) -> None:
    """Add one kernel call to ``SparsityStats`` as the plain kernel would (``stats.update`` reads the fields)."""
    if stats is None or not stats.enabled:
        return
    B, H, Q = result.kept.shape
    shape = torch.zeros((), device=result.kept.device).expand(B, H, Q, key_len)  # logits are never materialised
    rows = RowBlock(layer, phase, shape, result.n[:, None, :].long())
    rows.kept_counts = result.kept.long()
    rows.clamped_rows = clamped_rows
    if sparse:
        rows.kept_mass = result.kept_mass[..., None]
        rows.empty = result.empty
        if phase == "decode":
            vrows = result.vrows_per_kv_head()
            if vrows is None:
                raise ValueError("decode statistics need the kept V rows: use decode_attention for decode steps")
            rows.vrow_counts = vrows
    stats.update(rows)
