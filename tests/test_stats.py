import math

import numpy as np
import pytest

from codedojo.stats import ratio_interval, wilson_interval


def test_the_wilson_interval_of_a_rate():
    lo, hi = wilson_interval(5, 10)
    assert math.isclose(lo, 0.2366, abs_tol=1e-4) and math.isclose(hi, 0.7634, abs_tol=1e-4)
    lo, hi = wilson_interval(0, 10)  # not empty where every trial failed
    assert math.isclose(lo, 0.0, abs_tol=1e-12) and math.isclose(hi, 0.2775, abs_tol=1e-4)
    assert wilson_interval(10, 10)[1] == 1.0
    narrow, wide = wilson_interval(500, 1000), wilson_interval(5, 10)
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 5  # ten times the trials
    surer = wilson_interval(5, 10, level=0.99)
    assert surer[0] < wide[0] and surer[1] > wide[1]
    for k, n in ((11, 10), (-1, 10), (0, 0)):
        with pytest.raises(ValueError, match=f"{k} passes of {n} trials"):
            wilson_interval(k, n)


def test_a_ratio_of_sums_over_units_has_the_units_spread():
    same = ratio_interval([3, 3, 3], [4, 4, 4])  # units alike: no spread
    assert same == pytest.approx((0.75, 0.75))
    rng = np.random.default_rng(1)
    den = rng.integers(20, 40, size=24).astype(float)
    num = den * rng.uniform(0.5, 0.9, size=24)  # prompts easy and hard to draft
    lo, hi = ratio_interval(num, den)
    point = num.sum() / den.sum()
    assert lo < point < hi and 0.02 < hi - lo < 0.2
    assert ratio_interval(num, den) == (lo, hi)  # seeded
    more = ratio_interval(np.tile(num, 4), np.tile(den, 4))  # four times the prompts
    assert more[1] - more[0] < (hi - lo) * 0.7
    assert ratio_interval([1, 0], [2, 0]) == pytest.approx((0.5, 0.5))  # a unit with no rounds


def test_rows_of_one_unit_are_drawn_together():
    """Twenty windows of a file the drafts always follow and twenty of one they never do: two
    files, which tell little (the share could be anything), not forty independent prompts."""
    num, den = [1.0] * 20 + [0.0] * 20, [1.0] * 40
    files = ["a.py"] * 20 + ["b.py"] * 20
    assert ratio_interval(num, den, units=files) == (0.0, 1.0)
    lo, hi = ratio_interval(num, den)  # every row a unit of its own
    assert 0.2 < lo < 0.5 < hi < 0.8
    assert ratio_interval(num, den, units=range(40)) == (lo, hi)
    with pytest.raises(ValueError, match="3 units for 40 rows"):
        ratio_interval(num, den, units=[0, 1, 2])


def test_a_ratio_interval_names_bad_input():
    with pytest.raises(ValueError, match="one of each per unit"):
        ratio_interval([1, 2], [1])
    with pytest.raises(ValueError, match="at least one unit"):
        ratio_interval([], [])
    with pytest.raises(ValueError, match="positive sum"):
        ratio_interval([1], [0])
    with pytest.raises(ValueError, match="level 1.5"):
        wilson_interval(1, 2, level=1.5)
    with pytest.raises(ValueError, match="level 0"):
        ratio_interval([1], [2], level=0)
