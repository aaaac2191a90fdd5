"""Matched sparsity: the k at which a run keeps a target fraction of the attention elements.

Methods compared at the same k keep different amounts (Top-θ pre-softmax keeps 20-35 % more than Top-k at the
aggressive end, post-softmax 4-5 % more), so a fair comparison fixes the kept fraction instead
(``sparsifier.target_kept``). The fraction is over every layer's prefill attention elements, as
``SparsityStats.kept_attention_fraction`` counts them, on the calibration rows (built as the evaluated rows are:
same shots, same sampler), which stand in for the evaluated ones.

* Top-k keeps exactly min(k_l, n) of a row of n keys in layer l, so its fraction is known from the row lengths
  and the layers' sliding windows alone (:func:`topk_kept_fraction`; a window of w keys holds a row to min(n, w)
  keys, as in five of Gemma-3's every six layers) and the k is found by bisection (:func:`topk_k_for`).
* Top-θ keeps what its calibrated thresholds let through: :func:`resolve_k` starts at Top-k's k, measures the
  fraction the thresholds of that k keep on the calibration rows, and corrects k by the ratio of that fraction to
  Top-k's over the layers k governs, until the measurement is within ``tolerance`` of the target.

A target below what the layers of ``layer_k`` keep on their own (k = 1 everywhere else) cannot be reached:
:class:`Unreachable` says so, naming the fix.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

TOLERANCE = 0.05  # relative, on the calibration rows: the evaluated rows then land within ±10 %


class Unreachable(ValueError):
    """The target kept fraction is below what the run keeps at k = 1."""


def _kept_per_sequence(length: int, k: int) -> int:
    """Σ_{n=1..length} min(k, n): the elements Top-k keeps in the causal rows of one sequence (also the valid
    elements of a sliding window of k keys: its rows hold min(n, k) keys)."""
    m = min(k, length)
    return m * (m + 1) // 2 + (length - m) * k


def _layer_counts(lengths: Sequence[int], k: int, layer_k: dict[int, int] | None, num_layers: int,
                  windows: Sequence[int | None] | None) -> list[tuple[int, int]]:
    """(kept, valid) elements of each layer: layer l keeps ``layer_k.get(l, k)`` keys of rows that hold the causal
    keys within its sliding window (``windows[l]``; None: every earlier key)."""
    if not lengths or num_layers < 1:
        raise ValueError("topk_kept_fraction needs at least one sequence and one layer")
    if windows is not None and len(windows) != num_layers:
        raise ValueError(f"windows names {len(windows)} layers, the model has {num_layers}")
    layer_k = layer_k or {}
    counts = []
    for layer in range(num_layers):
        window = windows[layer] if windows is not None else None
        keep = layer_k.get(layer, k) if window is None else min(layer_k.get(layer, k), window)
        valid = sum(L * (L + 1) // 2 if window is None else _kept_per_sequence(L, window) for L in lengths)
        counts.append((sum(_kept_per_sequence(L, keep) for L in lengths), valid))
    return counts


def topk_kept_fraction(lengths: Sequence[int], k: int, layer_k: dict[int, int] | None, num_layers: int,
                       windows: Sequence[int | None] | None = None) -> float:
    """The fraction of attention elements Top-k keeps over ``num_layers`` layers on causal sequences of
    ``lengths`` tokens (each sequence's rows have 1..L keys, at most ``windows[l]`` in a sliding-window layer),
    layer l keeping ``layer_k.get(l, k)``."""
    counts = _layer_counts(lengths, k, layer_k, num_layers, windows)
    return sum(kept for kept, _ in counts) / sum(valid for _, valid in counts)


def _floor(lengths, layer_k, num_layers, windows=None) -> float:
    return topk_kept_fraction(lengths, 1, layer_k, num_layers, windows)


def _fixed(lengths, layer_k, num_layers, windows) -> float:
    """What the layers of ``layer_k`` keep, as a fraction of every layer's elements."""
    counts = _layer_counts(lengths, 1, layer_k, num_layers, windows)
    return sum(kept for layer, (kept, _) in enumerate(counts) if layer in (layer_k or {})) / \
        sum(valid for _, valid in counts)


def topk_k_for(lengths: Sequence[int], target: float, layer_k: dict[int, int] | None, num_layers: int,
               tolerance: float = TOLERANCE, windows: Sequence[int | None] | None = None) -> int:
    """The k (≥ 1) whose Top-k kept fraction on ``lengths`` is closest to ``target``; raises Unreachable when even
    k = 1 keeps more than ``target`` × (1 + ``tolerance``)."""
    if not 0 < target <= 1:
        raise ValueError(f"target kept fraction must be in (0, 1], got {target!r}")
    floor = _floor(lengths, layer_k, num_layers, windows)
    if floor > target * (1 + tolerance):
        raise Unreachable(_unreachable(target, floor, layer_k))
    fraction = lambda k: topk_kept_fraction(lengths, k, layer_k, num_layers, windows)  # noqa: E731
    lo, hi = 1, max(lengths)  # kept(lo) <= target region ... kept(hi) = the most any k keeps
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fraction(mid) < target:
            lo = mid
        else:
            hi = mid
    return min((lo, hi), key=lambda k: abs(fraction(k) - target))


def _unreachable(target: float, floor: float, layer_k) -> str:
    return (f"target_kept={target:g} cannot be reached: at k = 1 the run still keeps {floor:.4f} of the attention "
            f"elements on the calibration rows (the layers of sparsifier.layer_k={dict(layer_k or {})} keep that "
            f"much on their own). Raise sparsifier.target_kept above {floor:.4f}, or give those layers a smaller k "
            "(e.g. sparsifier.layer_k={0:128,1:128}) or none (sparsifier.layer_k=null)")


def resolve_k(target: float, lengths: Sequence[int], layer_k: dict[int, int] | None, num_layers: int,
              measure: Callable[[int], float] | None = None, *, tolerance: float = TOLERANCE,
              max_steps: int = 5, windows: Sequence[int | None] | None = None,
              ) -> tuple[int, float, list[tuple[int, float]]]:
    """(k, kept fraction at k on the calibration rows, [(k, measured), ...] tried).

    ``measure(k)`` is the method's kept fraction at k (None: Top-k, whose fraction follows from ``lengths`` and the
    layers' sliding ``windows``). The layers of ``layer_k`` are assumed to keep what Top-k keeps there; the rest
    scale by the measured ratio.
    """
    fraction = lambda k: topk_kept_fraction(lengths, k, layer_k, num_layers, windows)  # noqa: E731
    k = topk_k_for(lengths, target, layer_k, num_layers, tolerance, windows)
    if measure is None:
        return k, fraction(k), []
    fixed = _fixed(lengths, layer_k, num_layers, windows)
    tried: list[tuple[int, float]] = []
    for _ in range(max_steps):
        kept = measure(k)
        tried.append((k, kept))
        if abs(kept / target - 1) <= tolerance:
            return k, kept, tried
        ratio = (kept - fixed) / max(fraction(k) - fixed, 1e-12)
        wanted = fixed + (target - fixed) / max(ratio, 1e-12)  # the Top-k fraction that this method turns into target
        try:
            step = topk_k_for(lengths, min(max(wanted, 1e-9), 1.0), layer_k, num_layers, tolerance=math.inf,
                              windows=windows)
        except Unreachable:
            step = 1
        if step == k or any(step == t for t, _ in tried):
            break
        k = step
    best_k, best = min(tried, key=lambda t: abs(t[1] / target - 1))
    if best_k == 1 and best > target * (1 + 2 * tolerance):
        raise Unreachable(_unreachable(target, best, layer_k))
    return best_k, best, tried
