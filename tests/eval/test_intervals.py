"""The interval of a median that bench/ puts on paired timing ratios."""

from __future__ import annotations

import math
import random

import pytest

from kvgate.eval.intervals import median_interval


def test_median_interval_takes_the_order_statistics_binomial_coverage_asks_for():
    # n = 10: [x_2, x_9] covers 97.9%, [x_3, x_8] only 89%; n = 30: [x_10, x_21]
    assert median_interval(range(10, 0, -1)) == (5.5, 2.0, 9.0)
    assert median_interval(range(1, 31)) == (15.5, 10.0, 21.0)
    # under 6 values no pair reaches 95%: the whole range
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert all(math.isnan(x) for x in median_interval([]))


def test_median_interval_covers_a_skewed_distributions_median_at_least_95_percent():
    rng = random.Random(0)
    true_median = math.log(2)  # of Exponential(1)
    for n in (8, 15, 40):
        hits = 0
        for _ in range(2000):
            _, lo, hi = median_interval([rng.expovariate(1.0) for _ in range(n)])
            hits += lo <= true_median <= hi
        assert hits / 2000 >= 0.94, (n, hits)


def test_shares_at_0_or_100_percent_have_intervals_of_width():
    """Issue #64 case 9: 2 of 2 read 100.0-100.0 and 96 of 96 "100 [100, 100]" (a bootstrap of
    a sample that is all 100 gives only 100 back). Wilson's: 2 of 2 [34.2, 100], 96 of 96
    [96.2, 100], one row or the average of two families of 48."""
    from kvgate.eval.intervals import mean_interval, share_interval, wilson

    assert mean_interval([100.0] * 2) == pytest.approx((34.24, 100.0), abs=0.01)
    for groups in ([[100.0] * 96], [[100.0] * 48, [100.0] * 48]):
        assert share_interval(groups) == pytest.approx((96.15, 100.0), abs=0.01)
    assert share_interval([[100.0] * 96]) == pytest.approx(wilson(96, 96))
    assert share_interval([[0.0] * 96]) == pytest.approx((0.0, 3.85), abs=0.01)
    # every example equal but not at an edge: the sample could have gone otherwise too
    lo, hi = share_interval([[50.0] * 10])
    assert lo < 50.0 < hi
    # hits inside: Wilson's exactly; partial credit narrows it by its own variance
    assert mean_interval([0.0, 100.0, 100.0]) == wilson(2, 3)
    assert share_interval([[60.0] * 5 + [40.0] * 5])[0] > share_interval([[100.0] * 5 + [0.0] *
                                                                           5])[0]


def test_paired_differences_at_the_edges_have_intervals_of_width():
    """Both policies at 96 of 96 differ by 0 [-3.8, +3.8] (either could have missed one), not
    [0, 0]; 2 of 2 against 0 of 2 is not "+100 [100, 100]"."""
    from kvgate.eval.intervals import paired_share_interval

    assert paired_share_interval([[(100.0, 100.0)] * 96]) == pytest.approx((-3.85, 3.85),
                                                                           abs=0.01)
    lo, hi = paired_share_interval([[(100.0, 0.0)] * 2])
    assert 0.0 < lo < 50.0 and hi == pytest.approx(100.0)
    # one family of hits: Newcombe's (1998) method 10 from the 2x2 table of the pairs
    for a, b, c, d in ((8, 5, 1, 36), (30, 0, 2, 0), (0, 3, 0, 7)):
        pairs = ([(100.0, 100.0)] * a + [(100.0, 0.0)] * b + [(0.0, 100.0)] * c
                 + [(0.0, 0.0)] * d)
        assert paired_share_interval([pairs]) == pytest.approx(newcombe_10(a, b, c, d))


def newcombe_10(a: int, b: int, c: int, d: int) -> tuple[float, float]:
    """Newcombe's method 10 as he writes it: Wilson's limits of p1 = (a+b)/n and p2 = (a+c)/n,
    joined with phi, the correlation of the 2x2 table (0 where a margin is empty)."""
    from kvgate.eval.intervals import wilson

    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = ([x / 100 for x in wilson(k, n)] for k in (a + b, a + c))
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    delta = math.sqrt((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2)
    eps = math.sqrt((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2)
    return 100 * (p1 - p2 - delta), 100 * (p1 - p2 + eps)


def test_share_intervals_cover_near_the_edges():
    """The average over two families of 48 hits at 97% and 90% (true mean 93.5): covered about
    95% of the time, where the bootstrap's zero-width edges fall short."""
    from kvgate.eval.intervals import share_interval, stratified_interval

    rng = random.Random(0)
    covered = {"share": 0, "bootstrap": 0}
    for _ in range(400):
        groups = [[100.0 * (rng.random() < p) for _ in range(48)] for p in (0.97, 0.90)]
        for name, interval in (("share", share_interval), ("bootstrap", stratified_interval)):
            lo, hi = interval(groups) if name == "share" else interval(groups, resamples=200)
            covered[name] += lo <= 93.5 <= hi
    assert covered["share"] / 400 >= 0.92
    assert covered["share"] > covered["bootstrap"]
