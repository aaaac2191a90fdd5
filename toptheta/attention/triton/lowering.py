"""From the project's objects to the kernels' plain tensors, and back to the statistics (torch only).

The kernels take per-row tensors (``theta``, ``sdc_mass``); these helpers build them from a ``TopTheta``
sparsifier exactly as ``TopTheta.select`` decides (rows with n ≤ k, and uncalibrated rows, are kept whole:
θ = −inf), and feed a kernel's per-row counts to ``SparsityStats`` through the same ``RowBlock`` fields the
C++ fast paths fill, so the statistics are the plain kernel's.
"""

from __future__ import annotations

import torch

from ...sparsifiers.base import RowBlock
from .common import TritonAttention


def row_thresholds(sparsifier, layer: int, n: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(θ (B, H|1, Q) float32 for the kernels, rows clamped at the calibrated maximum) for rows of lengths n (B, Q)."""
    theta, clamped = sparsifier.thresholds.lookup(layer, n[:, None, :].long())  # (B, H|1, Q)
    whole = (n <= sparsifier.k_for(layer))[:, None, :]  # (B, 1, Q) short rows: not sparsified (method.md §1)
    return torch.where(whole, float("-inf"), theta.float()).contiguous(), clamped


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
