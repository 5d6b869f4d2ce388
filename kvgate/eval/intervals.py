"""95% intervals of mean scores over examples.

- :func:`wilson`: the Wilson score interval of a share of hits (scores that are all 0 or 100);
- :func:`bootstrap`: the percentile bootstrap of a mean (partial-credit scores), seeded so a
  table is reproducible;
- :func:`mean_interval` picks one of the two; :func:`stratified_interval` is the interval of a
  mean of group means (e.g. the average over task families), resampling within each group;
- :func:`median_interval`: a distribution-free interval of a median (order statistics), for
  paired timing ratios in ``bench/``.

All but :func:`median_interval` take and return percentages.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054
RESAMPLES = 1000


def wilson(hits: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (in %) of ``hits`` out of ``n``; (nan, nan) when n is 0."""
    if n <= 0:
        return math.nan, math.nan
    p = hits / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return 100.0 * max(0.0, centre - half), 100.0 * min(1.0, centre + half)


def _percentiles(means: list[float]) -> tuple[float, float]:
    means.sort()
    lo = means[int(0.025 * (len(means) - 1))]
    hi = means[math.ceil(0.975 * (len(means) - 1))]
    return lo, hi


def bootstrap(values: Sequence[float], resamples: int = RESAMPLES,
              seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``."""
    return stratified_interval([values], resamples, seed)


def stratified_interval(groups: Sequence[Sequence[float]], resamples: int = RESAMPLES,
                        seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of the mean of the group means (each group resampled on its own)."""
    groups = [list(g) for g in groups if len(g)]
    if not groups:
        return math.nan, math.nan
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        total = 0.0
        for g in groups:
            total += sum(g[rng.randrange(len(g))] for _ in g) / len(g)
        means.append(total / len(groups))
    return _percentiles(means)


def mean_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """Wilson when every score is 0 or 100 (hits), else the bootstrap."""
    values = list(values)
    if all(v in (0.0, 100.0) for v in values):
        return wilson(sum(v == 100.0 for v in values), len(values))
    return bootstrap(values, seed=seed)


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, lo, hi): ``[x_(j), x_(n+1-j)]`` of the sorted values, the narrowest such pair
    that covers the population median with probability >= ``level`` whatever the distribution
    (the count of values below the median is Binomial(n, 1/2)). Under 6 values no pair reaches
    95%: then the whole range, whose coverage is 1 - 2^(1-n)."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan
    median = (xs[(n - 1) // 2] + xs[n // 2]) / 2
    j = 1
    # widen inward while the next pair [x_(j+1), x_(n-j)] still covers with >= level: it
    # misses when more than n - j - 1 or fewer than j + 1 values fall below the median
    while j + 1 <= n - j and 2 * sum(math.comb(n, i) for i in range(j + 1)) / 2 ** n <= 1 - level:
        j += 1
    return median, xs[j - 1], xs[n - j]
