"""The one quantile every benchmark reports (percentiles of latencies, compile times, TTFT)."""

from __future__ import annotations

import math
from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    """The `q`-quantile (0 <= q <= 1) of `values`, interpolated linearly between the two
    nearest ranks: numpy's default `percentile` method and what `vllm bench serve` reports
    (`quantile(v, 0.5)` is the median). NaN when there are no values."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    n = len(ordered)
    # NOTE: numpy's index and interpolation written out, so both give the same float
    position = (n - 1) * q
    below = min(math.floor(position), n - 1)
    above = min(below + 1, n - 1)
    fraction = position - below
    low, high = ordered[below], ordered[above]
    if fraction < 0.5:
        return low + (high - low) * fraction
    return high - (high - low) * (1.0 - fraction)
