"""Intervals for the rates the benchmarks report, so that two runs' figures can be told apart
from the spread of their samples: a pass rate over tasks (`wilson_interval`), and a ratio of
sums over prompts, as acceptance rates and tokens per second are (`ratio_interval`)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from statistics import NormalDist

import numpy as np


def wilson_interval(k: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a rate k/n (k passes of n independent trials): unlike the
    normal approximation it stays inside [0, 1] and is not empty at k = 0 or k = n. ``k`` may
    be fractional: n units, each with its own pass rate, their rates summed."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"wilson_interval: {k} passes of {n} trials")
    z = _z(level)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def ratio_interval(num: Sequence[float], den: Sequence[float], level: float = 0.95,
                   draws: int = 2000, seed: int = 0,
                   units: Sequence[Hashable] | None = None) -> tuple[float, float]:
    """A percentile bootstrap interval of sum(num) / sum(den) over units (prompts, requests):
    the units are drawn again with replacement ``draws`` times, each draw's ratio of sums
    taken. Units differ (one prompt's text is easy to draft, another's is not), so the
    interval is that of the units' spread, not of the tokens' within them. ``units``: each
    row's unit, where rows are not independent (windows cut from one file are alike): the
    rows of a unit are summed into one; default, every row a unit of its own."""
    a, b = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if a.ndim != 1 or a.shape != b.shape or len(a) == 0:
        raise ValueError(f"ratio_interval: {a.shape} numerators against {b.shape} "
                         "denominators; one of each per unit, at least one unit")
    if units is not None:
        if len(units) != len(a):
            raise ValueError(f"ratio_interval: {len(units)} units for {len(a)} rows")
        index = {u: i for i, u in enumerate(dict.fromkeys(units))}
        of = np.array([index[u] for u in units])
        a, b = np.bincount(of, weights=a), np.bincount(of, weights=b)
    if b.sum() <= 0 or (b < 0).any():
        raise ValueError("ratio_interval: denominators must be >= 0 with a positive sum")
    picks = np.random.default_rng(seed).integers(0, len(a), size=(draws, len(a)))
    tops, bottoms = a[picks].sum(1), b[picks].sum(1)
    ratios = tops[bottoms > 0] / bottoms[bottoms > 0]  # a draw of only empty units: none
    tail = (1 - _level(level)) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


def _level(level: float) -> float:
    if not 0 < level < 1:
        raise ValueError(f"level {level} outside (0, 1)")
    return level


def _z(level: float) -> float:
    """The standard normal quantile of a two-sided ``level``."""
    return NormalDist().inv_cdf(0.5 + _level(level) / 2)
