"""Means over seeds with their intervals."""

import math

import pytest

from testbed.report.stats import estimate, separated, t975


def test_five_seeds_get_a_t_interval():
    e = estimate([1, 2, 3, 4, 5])
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)  # t(4) x sample sd / sqrt(n)
    assert e.kind == "ci95" and e.mean == 3
    assert (e.lo, e.hi) == pytest.approx((3 - half, 3 + half))
    assert e.text(".3g") == f"3 ± {half:.3g}"


def test_under_five_seeds_get_their_spread_and_one_gets_no_interval():
    assert estimate([2.0, 1.0, 4.0]).__dict__ == dict(mean=7 / 3, lo=1, hi=4, n=3, kind="range")
    one = estimate([2.0, None, math.nan])
    assert (one.kind, one.n, one.lo, one.hi) == ("single", 1, 2.0, 2.0)
    assert estimate([]).n == 0 and estimate([]).text() == "-"


def test_separated_only_where_intervals_do_not_overlap():
    low, high = estimate([1, 1.1, 0.9, 1.0, 1.05]), estimate([2, 2.1, 1.9, 2.0, 2.05])
    wide = estimate([0, 3, 1, 2, 1.5])
    assert separated(low, high) and separated(high, low)
    assert not separated(low, wide)
    assert not separated(estimate([1.0]), estimate([5.0]))  # no variation stated


def test_t_quantiles():
    assert t975(1) == 12.706 and t975(30) == 2.042 and t975(200) == 1.96
    with pytest.raises(ValueError):
        t975(0)
