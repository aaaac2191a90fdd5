"""Matched sparsity for the baselines: the p (top-p) or λ (skip-softmax) that keeps a target fraction.

``sparsifier.target_kept`` fixes the fraction of attention elements a run keeps on its calibration rows
(``target_kept.py`` finds Top-k's and Top-θ's k). Top-p and skip-softmax have no k: each has one parameter whose
kept fraction moves one way, more mass p keeps more, a larger λ keeps less. :func:`fit_parameter` narrows a
bracket on it (λ on a log scale; interpolating log(kept) once both ends are measured) to the same tolerance,
measuring the fraction with the caller's ``measure`` (the pipeline runs the calibration rows through the
sparsified model). A target outside what the parameter's range can reach is
refused (:class:`~.target_kept.Unreachable`), naming the fix.
"""

from __future__ import annotations

import math
from typing import Callable

from ..registry import Parameter  # a sparsifier's parameter is part of its registration
from .target_kept import TOLERANCE, Unreachable


def fit_parameter(target: float, parameter: Parameter, measure: Callable[[float], float], *,
                  tolerance: float = TOLERANCE, max_steps: int = 14, start: float | None = None,
                  slope: float | None = None) -> tuple[float, float, list[tuple[float, float]]]:
    """(value, kept fraction at value, [(value, measured), ...] tried) for the value whose measured kept fraction is
    within ``tolerance`` (relative) of ``target``, else the closest of ``max_steps`` steps.

    ``start``: the first value to try, a guess (Top-θ's k search starts at the k Top-k needs, as ``resolve_k``
    does). ``slope``: d log(kept) / d(search axis) near the target (``log_slope`` of a cheaper fit); while only one end
    of the bracket is measured, the next value steps from it along that slope (along the secant of the last two
    values once they are measured) instead of halving a bracket that may span the whole range. Both matter where a
    measure is expensive: each k Top-θ tries is a calibration.

    Raises Unreachable when even the end of the range that keeps least keeps more than the target allows (e.g. the
    layers of layer_k keep too much on their own) or the end that keeps most keeps too little."""
    if not 0 < target <= 1:
        raise ValueError(f"target kept fraction must be in (0, 1], got {target!r}")
    lo, hi = parameter.low, parameter.high  # the value keeping less is `fewer`, the one keeping more `more`
    fewer, more = (lo, hi) if parameter.keeps_more_when_higher else (hi, lo)
    at: dict[float, float] = {}  # kept fraction measured at a bracket end
    tried: list[tuple[float, float]] = []
    slow = False  # the last interpolation shrank the bracket by less than half: bisect once
    if start is not None and not min(lo, hi) <= start <= max(lo, hi):
        raise ValueError(f"start={start!r} is outside {parameter.key}'s range [{lo:g}, {hi:g}]")
    for step in range(max_steps):
        before = abs(_axis(parameter, more) - _axis(parameter, fewer))
        value, how = (start, "start") if step == 0 and start is not None else (None, "bisected")
        if value is None and not slow:
            value, how = _interpolated(parameter, target, fewer, more, at), "interpolated"
            if value is None:
                value, how = _extrapolated(parameter, target, fewer, more, at, tried, slope), "extrapolated"
        if value is None:
            value, how = parameter.between(fewer, more), "bisected"
        kept = measure(value)
        tried.append((value, kept))
        at[value] = kept
        if abs(kept / target - 1) <= tolerance:
            return value, kept, tried
        if kept > target:
            more = value
        else:
            fewer = value
        # an interpolation that shrank the bracket by less than half is followed by a bisection (a step from one
        # measured end cannot shrink it much: the other end is still the range's)
        slow = how == "interpolated" and abs(_axis(parameter, more) - _axis(parameter, fewer)) > before / 2
    value, kept = min(tried, key=lambda t: abs(t[1] / target - 1))
    if abs(kept / target - 1) > 2 * tolerance:
        edge = "least" if kept > target else "most"
        raise Unreachable(
            f"target_kept={target:g} cannot be reached with sparsifier.{parameter.key} in [{parameter.low:g}, "
            f"{parameter.high:g}]: the closest, {parameter.key}={value:g}, keeps {kept:.4f} on the calibration rows "
            f"(the range's end that keeps {edge}). Move sparsifier.target_kept towards {kept:.4f}"
            + (", or give the layers of sparsifier.layer_k a smaller k (e.g. {0:128,1:128}) or none "
               "(sparsifier.layer_k=null)" if kept > target else ""))
    return value, kept, tried


def _axis(parameter: Parameter, value: float) -> float:
    """Where ``value`` sits on the axis the search halves: log λ, p itself."""
    return math.log(value) if parameter.log else value


def log_slope(parameter: Parameter, tried: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of log(kept) against the search axis over ``tried`` (kept > 0); None without two
    distinct values or with a slope of the wrong sign for the parameter."""
    points = [(_axis(parameter, v), math.log(f)) for v, f in tried if f > 0]
    if len({x for x, _ in points}) < 2:
        return None
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope if (slope > 0) == parameter.keeps_more_when_higher and slope != 0 else None


def _extrapolated(parameter: Parameter, target: float, fewer: float, more: float, at: dict[float, float],
                  tried: list[tuple[float, float]], slope: float | None) -> float | None:
    """With a ``slope`` and one end of the bracket measured: the value where log(kept) reaches log(target) along the
    secant of the last two values tried (when its slope has the parameter's sign), else along ``slope``; kept inside
    the bracket's middle 96 %. None otherwise (the search then bisects, as it always did without a slope)."""
    ends = [end for end in (fewer, more) if at.get(end, 0) > 0]
    if slope is None or len(ends) != 1:
        return None
    secant = log_slope(parameter, tried[-2:]) if len(tried) >= 2 else None
    slope = secant if secant is not None else slope
    x = _axis(parameter, ends[0]) + (math.log(target) - math.log(at[ends[0]])) / slope
    a, b = sorted((_axis(parameter, fewer), _axis(parameter, more)))
    x = min(b - 0.02 * (b - a), max(a + 0.02 * (b - a), x))
    return math.exp(x) if parameter.log else x


def _interpolated(parameter: Parameter, target: float, fewer: float, more: float,
                  at: dict[float, float]) -> float | None:
    """The value where log(kept) reaches log(target) on the line through the bracket's two measured ends (on the
    search axis), kept inside the bracket's middle 96 %; None while an end is unmeasured or keeps nothing.

    The kept fraction is close to a power of λ (and smooth in p), so this lands within the tolerance in one or two
    steps where halving the bracket took five or six (a measure is a pass over the calibration rows, or a decode of
    the target prompts: minutes on long rows). A step that does not halve the bracket is followed by a bisection,
    so the search never does worse than every other step bisecting."""
    if at.get(fewer, 0) <= 0 or at.get(more, 0) <= 0:
        return None
    y_fewer, y_more = math.log(at[fewer]), math.log(at[more])
    if not y_fewer < math.log(target) < y_more:
        return None
    t = min(0.98, max(0.02, (math.log(target) - y_fewer) / (y_more - y_fewer)))
    x = _axis(parameter, fewer) + t * (_axis(parameter, more) - _axis(parameter, fewer))
    return math.exp(x) if parameter.log else x
