"""95% intervals of mean scores over examples.

- :func:`wilson`: the Wilson score interval of a share of hits (scores that are all 0 or 100);
- :func:`share_interval`: the interval of a mean of group means of scores in [0, 100] (one
  group: a row; several: the average over task families), and :func:`paired_share_interval`
  that of a difference of two such means on the same examples; both hold at 0 and 100%;
- :func:`mean_interval`: a row's interval, Wilson's for hits, else :func:`share_interval`;
- :func:`bootstrap` / :func:`stratified_interval`: the seeded percentile bootstrap of a mean
  (of group means), for numbers that are not shares (a per-family gap to a varying reference);
- :func:`median_interval`: a distribution-free interval of a median (order statistics), for
  paired timing ratios in ``bench/``.

All but :func:`median_interval` take and return percentages.

Why not the bootstrap for shares: resampling a sample whose scores are all 100 (or all 0)
gives only that value back, so 96 of 96 read "[100, 100]" and 2 of 2 did too, as if nothing
could have gone otherwise; Wilson's interval of 96 of 96 is [96.2, 100], of 2 of 2 [34.2, 100].
:func:`share_interval` is Wilson's interval at the mean with an effective sample size, as
Korn & Graubard (1998, "Confidence intervals for proportions with small expected number of
positive counts estimated from survey data", Survey Methodology 24:193-201) do for survey
estimates: n* = p(1 - p) / v, v the variance of the mean of group means (each group's sample
variance over its size, weighted 1/k^2). Where v is 0 (every group at one value: all 0 or 100)
n* is the groups' own size, (sum over groups of 1 / (k^2 n_g))^-1, which is n for equal groups:
so one group of hits is exactly Wilson's interval, and partial credit narrows it by its own
variance. :func:`paired_share_interval` joins the two means' intervals by the method of
variance estimates recovery (MOVER; Zou & Donner 2008, "Construction of confidence limits
about effect measures: a general approach", Statistics in Medicine 27:1693-1702) with the
correlation of the two means; for one group of 0/100 scores it is Newcombe's (1998) method 10
for paired proportions ("Improved confidence intervals for the difference between binomial
proportions based on paired data", Statistics in Medicine 17:2635-2650), whose coverage holds
at 0 and 100% where a paired bootstrap collapses to a point.
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


def _wilson_at(p: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson's interval (in %) of a share ``p`` (0-1) estimated with (effective) size ``n``."""
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
    return 100.0 * max(0.0, centre - half), 100.0 * min(1.0, centre + half)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _moments(groups: list[list[float]]) -> tuple[float, float, float]:
    """(mean of group means, its variance, the groups' own size) of shares in [0, 1]."""
    k = len(groups)
    mean = _mean([_mean(g) for g in groups])
    var = sum(_mean([(v - _mean(g)) ** 2 for v in g]) / len(g) for g in groups) / k ** 2
    return mean, var, k ** 2 / sum(1.0 / len(g) for g in groups)


def _effective(mean: float, var: float, size: float) -> float:
    """Korn & Graubard's effective size; the groups' own where the variance is 0 (see the
    module docstring)."""
    return mean * (1.0 - mean) / var if var > 0.0 and 0.0 < mean < 1.0 else size


def share_interval(groups: Sequence[Sequence[float]], z: float = Z95) -> tuple[float, float]:
    """95% interval of the mean of group means of scores in [0, 100]: Wilson's at an effective
    sample size (module docstring); never of zero width, (nan, nan) without scores."""
    groups = [[float(v) / 100.0 for v in g] for g in groups if len(g)]
    if not groups:
        return math.nan, math.nan
    mean, var, size = _moments(groups)
    return _wilson_at(min(max(mean, 0.0), 1.0), _effective(mean, var, size), z)


def paired_share_interval(groups: Sequence[Sequence[tuple[float, float]]],
                          z: float = Z95) -> tuple[float, float]:
    """95% interval (in points) of the mean over groups of ``a - b``, each group's pairs
    ``(a, b)`` two scores in [0, 100] of one example: MOVER on the two means'
    :func:`share_interval` with their correlation (Newcombe's method 10 for one group of hits;
    module docstring). (nan, nan) without pairs."""
    groups = [[(float(a) / 100.0, float(b) / 100.0) for a, b in g] for g in groups if len(g)]
    if not groups:
        return math.nan, math.nan
    firsts = [[a for a, _ in g] for g in groups]
    seconds = [[b for _, b in g] for g in groups]
    (pa, va, size), (pb, vb, _) = _moments(firsts), _moments(seconds)
    la, ua = (x / 100.0 for x in _wilson_at(pa, _effective(pa, va, size), z))
    lb, ub = (x / 100.0 for x in _wilson_at(pb, _effective(pb, vb, size), z))
    k = len(groups)
    cov = sum(_mean([(a - _mean(fa)) * (b - _mean(sb)) for a, b in g]) / len(g)
              for g, fa, sb in zip(groups, firsts, seconds)) / k ** 2
    # Newcombe sets the correlation to 0 where a margin is empty (a mean's variance is 0)
    r = cov / math.sqrt(va * vb) if va > 0.0 and vb > 0.0 else 0.0
    diff = pa - pb
    low = diff - math.sqrt(max((pa - la) ** 2 + (ub - pb) ** 2
                               - 2 * r * (pa - la) * (ub - pb), 0.0))
    high = diff + math.sqrt(max((ua - pa) ** 2 + (pb - lb) ** 2
                                - 2 * r * (ua - pa) * (pb - lb), 0.0))
    return 100.0 * low, 100.0 * high


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
    """Wilson when every score is 0 or 100 (hits), else :func:`share_interval` of the one
    group (partial credit narrows it by its variance; ``seed`` is kept for callers of the
    bootstrap it replaced)."""
    values = list(values)
    if all(v in (0.0, 100.0) for v in values):
        return wilson(sum(v == 100.0 for v in values), len(values))
    return share_interval([values])


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
