"""The confidence intervals of the tools' tables (trainer/tools/intervals.py)."""

import math

import pytest

from trainer.tools.intervals import clustered_mean_interval, mean_interval, t_critical


def test_the_t_interval_matches_student_s_quantiles():
    # two-sided 95% and 99% quantiles (any statistics table)
    for df, expected in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (7, 2.3646), (8, 2.3060), (30, 2.0423)]:
        assert t_critical(0.95, df) == pytest.approx(expected, abs=1e-4)
    assert t_critical(0.99, 4) == pytest.approx(4.6041, abs=1e-4)
    mean, half = mean_interval([0.1, 0.2, 0.3])
    assert (mean, half) == pytest.approx((0.2, 4.3027 * 0.1 / 3 ** 0.5), abs=1e-5)
    assert math.isnan(mean_interval([0.4])[1])  # one value has no interval


def test_the_clustered_interval_weighs_items_and_spreads_by_cluster():
    # equal counts: the t interval of the clusters' means
    assert clustered_mean_interval([2.0, 4.0, 9.0], [2, 2, 2]) == pytest.approx(mean_interval([1.0, 2.0, 4.5]))
    # the mean is per item: 3 items of 1 and 1 item of 5 -> 2, not the clusters' 3
    mean, half = clustered_mean_interval([3.0, 5.0], [3, 1])
    assert mean == pytest.approx(2.0)
    # linearised: residuals (3 - 2*3)/2 = -1.5 and (5 - 2)/2 = 1.5, variance 4.5 / 2
    assert half == pytest.approx(12.7062 * (4.5 / 2) ** 0.5, rel=1e-5)
    assert all(math.isnan(value) for value in clustered_mean_interval([1.0, 7.0], [0, 0]))  # no items
