"""Clocks for the benchmarks, each returning seconds: wall time between device synchronisations,
the best of repeats, a CUDA graph's replays, CUDA events, and Triton's `do_bench`.

Which to use: `wall_seconds` for a whole run (a `generate`, a batch of requests);
`best_seconds_per_call` for a short call repeated (noise only ever adds time, so the fastest
repeat is the figure); `graph_seconds_per_call` for the device's own time of a kernel or a step,
with no launch overhead; `event_seconds_per_call` for back-to-back launches where the gaps that
leave the device idle count; `triton_seconds` where a figure compares with Triton's own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize() -> None:
    """Wait for the CUDA device, if there is one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn`, the device synchronised before and after."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def best_seconds_per_call(fn: Callable[[], object], iters: int = 1, repeats: int = 3) -> float:
    """Seconds per call of `fn`: the fastest of `repeats` timings of `iters` calls in a row."""
    return min(wall_seconds(lambda: [fn() for _ in range(iters)]) for _ in range(repeats)) / iters


def graph_seconds_per_call(fn: Callable[[], object], calls: int = 20, repeats: int = 5) -> float:
    """Seconds per call of `fn` captured `calls` times in one CUDA graph, the fastest of
    `repeats` replays (no launch overhead). `fn` runs once first, outside the graph."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return best_seconds_per_call(graph.replay, 1, repeats) / calls


def event_seconds_per_call(
    fn: Callable[[], object],
    iters: int,
    warmup: int = 3,
    graph: bool = False,
    cuda: bool | None = None,
) -> float:
    """Mean seconds per call over `iters` calls in a row after `warmup` calls: between two CUDA
    events on the device (so launch gaps that leave it idle count), by the perf counter when
    `cuda` is False (default: whether a CUDA device is present). `graph`: `fn` captured once in
    a CUDA graph and the graph replayed instead."""
    for _ in range(warmup):
        fn()
    if not (torch.cuda.is_available() if cuda is None else cuda):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    run = fn
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
        run()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def triton_seconds(fn: Callable[[], object], graph: bool = False, rep_ms: int = 50) -> float:
    """Triton's `do_bench` of `fn` (`do_bench_cudagraph` when `graph`), after one call of it."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms)) / 1e3
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms)) / 1e3
