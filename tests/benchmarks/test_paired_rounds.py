"""Ratios paired round by round, with the interval the rounds give their mean."""

from __future__ import annotations

import statistics

import pytest

from kvtier.benchmarks.paired_rounds import paired_ratio


def test_interval_is_students_t_over_the_rounds():
    got = paired_ratio([(1.1, 1.0), (0.9, 1.0), (1.0, 1.0), (1.2, 1.0)])
    assert got.by_round == pytest.approx((1.1, 0.9, 1.0, 1.2))
    assert got.mean == pytest.approx(1.05)
    half = 3.182 * statistics.stdev([1.1, 0.9, 1.0, 1.2]) / 2  # t(3 df) x s / sqrt(4)
    assert got.low == pytest.approx(1.05 - half) and got.high == pytest.approx(1.05 + half)
    assert got.low < 1.0 < got.high  # four rounds this spread cannot tell 1.05 from 1


def test_missing_rounds_are_left_out_and_one_round_gives_no_interval():
    got = paired_ratio([(2.0, 4.0), (None, 1.0), (1.0, None), (1.0, 0.0)])
    assert got.by_round == (0.5,) and got.mean == 0.5
    assert got.low is None and got.high is None
    assert got.as_dict() == {"by_round": [0.5], "mean": 0.5, "low": None, "high": None}
    assert paired_ratio([]) is None and paired_ratio([(None, 1.0)]) is None
