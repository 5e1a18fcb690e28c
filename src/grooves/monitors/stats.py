"""Small robust statistics for the metric detectors (pure Python: a step has tens of numbers)."""

from __future__ import annotations

import math
import statistics

MAD_TO_STD = 1.4826  # scales the median absolute deviation to a std for normal data


def finite(value) -> bool:
    """A usable number: not None, NaN or inf (numpy and torch scalars count)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def robust_z(value: float, past: list[float], min_scale: float, rel_min_scale: float) -> tuple[float, dict]:
    """Robust z-score of ``value`` against ``past``: (value - median) / scale and its parts.

    scale = max(1.4826 * MAD, min_scale, rel_min_scale * |median|). The floors keep a flat
    history (MAD = 0, e.g. a pass rate stuck at 1.0) from turning noise into a huge z.
    """
    centre = statistics.median(past)
    mad = statistics.median(abs(x - centre) for x in past)
    scale = max(MAD_TO_STD * mad, min_scale, rel_min_scale * abs(centre))
    z = (value - centre) / scale
    return z, {"median": round(centre, 6), "mad": round(mad, 6), "scale": round(scale, 6), "z": round(z, 3)}


def centred_correlation(groups_xy: list[list[tuple[float, float]]]) -> float:
    """Pearson correlation of x and y after removing each group's means (NaN when undefined).

    Centring within groups removes differences between tasks (a long source, an easy task):
    what is left is whether, among samples of the same task, longer ones score higher, which
    is what a group-relative advantage rewards.
    """
    xs, ys = [], []
    for pairs in groups_xy:
        if len(pairs) < 2:
            continue
        mean_x = statistics.fmean(x for x, _ in pairs)
        mean_y = statistics.fmean(y for _, y in pairs)
        xs += [x - mean_x for x, _ in pairs]
        ys += [y - mean_y for _, y in pairs]
    sxx, syy = sum(x * x for x in xs), sum(y * y for y in ys)
    if sxx <= 0 or syy <= 0:
        return math.nan
    return sum(x * y for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)
