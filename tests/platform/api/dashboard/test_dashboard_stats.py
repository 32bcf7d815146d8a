"""The dashboard's latency quantiles from histogram buckets, as Prometheus computes them."""

from __future__ import annotations

import pytest

from loraplex.platform.api.dashboard.stats import histogram_quantile

BOUNDS = (0.1, 0.2, 0.4, 0.8)


@pytest.mark.parametrize(
    ("q", "counts", "expected"),
    [
        (0.5, [0, 10, 0, 0, 0], 0.15),  # halfway into the (0.1, 0.2] bucket
        (0.5, [10, 0, 0, 0, 0], 0.05),  # the first bucket starts at 0
        (0.95, [5, 5, 5, 5, 0], 0.72),  # 19 of 20: 3/5 of the way through (0.4, 0.8]
        (0.25, [5, 5, 5, 5, 0], 0.1),  # exactly the first bucket's edge
        (0.99, [0, 0, 0, 1, 9], 0.8),  # in the +Inf bucket: the highest bound
        (0.0, [0, 0, 3, 0, 0], 0.2),  # the lowest non-empty bucket's lower edge
    ],
)
def test_quantile_interpolates_inside_its_bucket(q, counts, expected):
    assert histogram_quantile(q, BOUNDS, counts) == pytest.approx(expected)


def test_no_observations_no_quantile_and_q_is_checked():
    assert histogram_quantile(0.5, BOUNDS, [0] * 5) is None
    with pytest.raises(ValueError, match="q must be"):
        histogram_quantile(1.5, BOUNDS, [1] * 5)
