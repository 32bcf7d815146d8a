"""The benchmarks' clocks on the CPU: what each one times and divides by."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.common.timing import best_seconds_per_call, event_seconds_per_call, wall_seconds


def _stall(seconds: float):
    """A call that takes `seconds` (a stand-in workload of known length) and counts its runs."""
    calls = []

    def run() -> None:
        calls.append(None)
        time.sleep(seconds)

    return run, calls


def test_wall_seconds_times_one_call() -> None:
    run, calls = _stall(0.02)
    assert 0.02 <= wall_seconds(run) < 0.5
    assert len(calls) == 1


def test_best_seconds_per_call_divides_the_fastest_repeat_by_its_calls() -> None:
    run, calls = _stall(0.005)
    seconds = best_seconds_per_call(run, iters=4, repeats=3)
    assert len(calls) == 12
    assert 0.005 <= seconds < 0.1


def test_event_seconds_per_call_warms_up_first_and_times_the_rest() -> None:
    run, calls = _stall(0.005)
    seconds = event_seconds_per_call(run, iters=4, warmup=2, cuda=False)
    assert len(calls) == 6
    assert 0.005 <= seconds < 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_and_event_clocks_time_a_kernel_on_the_gpu() -> None:
    from benchmarks.common.timing import graph_seconds_per_call, triton_seconds

    x = torch.randn(1024, 1024, device="cuda")
    for seconds in (
        graph_seconds_per_call(lambda: x @ x),
        event_seconds_per_call(lambda: x @ x, iters=10),
        event_seconds_per_call(lambda: x @ x, iters=10, graph=True),
        triton_seconds(lambda: x @ x),
    ):
        assert 0 < seconds < 0.1
