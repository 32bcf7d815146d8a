"""The benchmarks' one quantile: numpy's default percentile, so server percentiles read as
`vllm bench serve`'s do."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from benchmarks.common.stats import quantile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([3.0, 1.0, 2.0], 0.5, 2.0),  # the median, in any order
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.5),  # between the two middle values
        ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
        ([10.0, 20.0], 0.9, 19.0),
        ([7.0], 0.99, 7.0),
    ],
)
def test_quantile_interpolates_between_the_nearest_ranks(values, q, expected) -> None:
    assert quantile(values, q) == pytest.approx(expected)


def test_quantile_is_numpy_percentile_to_the_bit() -> None:
    rng = random.Random(0)
    for _ in range(300):
        values = [rng.random() * 100 for _ in range(rng.randint(1, 40))]
        for percent in (50, 90, 99):
            assert quantile(values, percent / 100) == float(np.percentile(values, percent))


def test_no_values_give_nan_and_q_outside_0_1_is_refused() -> None:
    assert math.isnan(quantile([], 0.5))
    with pytest.raises(ValueError, match="q must be in"):
        quantile([1.0], 99)
