"""Confidence intervals for the tools' tables: Student's t interval of a mean, over a few
seeds or many prompts, without scipy (the trainer does not depend on it).

Student's t distribution with an integer number of degrees of freedom has a closed-form
CDF (Abramowitz and Stegun 26.7.3-4), so its quantile is found by bisection to float
precision.
"""

from __future__ import annotations

import math
import statistics


def _central_probability(t: float, df: int) -> float:
    """P(|T| <= t) for T ~ Student's t with ``df`` degrees of freedom (t >= 0)."""
    theta = math.atan(t / math.sqrt(df))
    cosine_sq = math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi * (theta + sin(theta) * cos(theta) * sum of 2.4../(1.3..) cos^2k)
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cosine_sq * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term, total = 1.0, 1.0  # even: sin(theta) * sum of 1.3../(2.4..) cos^2k
    for k in range(1, df // 2):
        term *= cosine_sq * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_critical(level: float, df: int) -> float:
    """The t with P(|T| <= t) = ``level`` (two-sided; 2.3646 for 0.95 at 7 degrees of freedom)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if df < 1:
        raise ValueError(f"df must be at least 1, got {df}")
    low, high = 0.0, 1.0
    while _central_probability(high, df) < level:
        high *= 2.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        low, high = (middle, high) if _central_probability(middle, df) < level else (low, middle)
    return high


def mean_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The mean of ``values`` and the half-width of its ``level`` t interval (nan with fewer
    than two values: one value has no spread to measure)."""
    values = [value for value in values if not math.isnan(value)]
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    return mean, t_critical(level, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def clustered_mean_interval(totals: list[float], counts: list[int], level: float = 0.95) -> tuple[float, float]:
    """The mean per item over clusters of correlated items (a prompt's responses): the
    sum of the clusters' ``totals`` over the sum of their ``counts``, and the half-width
    of its ``level`` interval from the clusters' spread (the ratio estimator's linearised
    variance, t with clusters - 1 degrees of freedom; with equal counts, the t interval of
    the clusters' means). Nan without items, and the half-width nan with one cluster."""
    pairs = [(total, count) for total, count in zip(totals, counts) if count]
    if not pairs:
        return math.nan, math.nan
    clusters, items = len(pairs), sum(count for _, count in pairs)
    mean = sum(total for total, _ in pairs) / items
    if clusters < 2:
        return mean, math.nan
    average = items / clusters
    spread = sum(((total - mean * count) / average) ** 2 for total, count in pairs) / (clusters * (clusters - 1))
    return mean, t_critical(level, clusters - 1) * math.sqrt(spread)


def format_interval(mean: float, half_width: float, *, digits: int = 3, signed: bool = False) -> str:
    """``0.812 [0.796, 0.828]``: the mean, then the interval's ends (with ``signed``, a
    difference: ``+0.012 [-0.004, +0.028]``)."""
    sign = "+" if signed else ""
    if math.isnan(half_width):
        return f"{mean:{sign}.{digits}f}"
    return f"{mean:{sign}.{digits}f} [{mean - half_width:{sign}.{digits}f}, {mean + half_width:{sign}.{digits}f}]"
