"""The interval of a median that bench/ puts on paired timing ratios."""

from __future__ import annotations

import math
import random

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
