"""The latency histogram of `blipmq bench` and bench/compare.py's workers."""

from __future__ import annotations

import random

from blipmq_cli.bench import Histogram


def test_quantiles_of_a_known_spread() -> None:
    values = list(range(1, 100_001))
    random.Random(7).shuffle(values)
    h = Histogram()
    for start in range(0, len(values), 512):  # batches, as subscribers take them
        h.add_all(values[start:start + 512])
    assert h.total == 100_000 and h.max == 100_000
    for q in (0.5, 0.95, 0.99):
        exact = q * 100_000
        assert abs(h.quantile(q) - exact) <= exact / 64  # 64 sub-buckets per power of two
    top = h.quantile(1.0)  # the middle of the last bucket, never above the max
    assert 100_000 - 100_000 / 64 <= top <= 100_000


def test_small_values_are_exact_and_negative_ones_count_as_zero() -> None:
    h = Histogram()
    h.add_all([-5, 0, 3, 3, 127])
    assert h.total == 5 and h.max == 127
    assert [h.quantile(q) for q in (0.2, 0.4, 0.6, 0.8, 1.0)] == [0, 0, 3, 3, 127]


def test_merge_adds_counts() -> None:
    a, b = Histogram(), Histogram()
    a.add_all([10, 20])
    b.add_all([30, 5000])
    a.merge(b.counts, b.max)
    assert a.total == 4 and a.max == 5000 and a.quantile(0.5) == 20
