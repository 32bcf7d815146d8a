"""Where the GPU time of one batch-1 decode step goes: the kernels of the captured CUDA graph,
summed by name, against the graph's wall time (the gap is launch and idle time inside it).

    python -m benchmarks.decode_profile [--model configs/models/llama-3.1-8b.json]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common.engine import LLAMA_8B, bench_llm, projection_shapes
from benchmarks.common.sampling_mixes import GREEDY
from benchmarks.common.timing import (
    best_seconds_per_call,
    graph_seconds_per_call,
    synchronize,
    wall_seconds,
)
from benchmarks.record import write_result
from loraplex import LLM, SamplingParams

_KINDS = (
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "splitk")),
    ("attention", ("attention", "attn")),
    ("rotary_kv", ("rotary", "kv_cache")),
    ("norm", ("norm",)),
    ("activation", ("silu", "act")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in _KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def engine_timeline(llm: LLM, context: int, steps: int) -> dict[str, float]:
    """Profile `steps` batch-1 decode steps through the engine: host API calls that can block
    (synchronisations, pinned allocations), kernels outside the graph, and GPU idle time."""
    prompt = [[1000 + i for i in range(context)]]
    params = SamplingParams(max_tokens=steps, **GREEDY)
    llm.generate(prompt, params)
    synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params)
        synchronize()
    wall = time.perf_counter() - start
    api: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((event.time_range.start, event.time_range.end))
        elif event.name.startswith(("cuda", "cu")) and not event.name.startswith("cudaGetDevice"):
            api[event.name][0] += 1
            api[event.name][1] += event.cpu_time_total
    spans.sort()
    busy, end = 0.0, None
    for lo, hi in spans:  # union of the GPU's busy intervals
        if end is None or lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    print(f"engine: {steps} tokens in {wall * 1e3:.1f} ms ({wall / steps * 1e3:.3f} ms/token, "
          f"profiled); GPU busy {busy / 1e3:.1f} ms")  # fmt: skip
    for name, (count, us) in sorted(api.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"  {name:40s} x{count:<6d} {us / 1e3:8.2f} ms")
    return {
        "engine_ms_per_token": wall / steps * 1e3,
        "engine_gpu_busy_fraction": busy / 1e3 / (wall * 1e3),
    }


def in_situ_steps(llm: LLM, context: int, steps: int) -> dict[str, float]:
    """Without the profiler: CUDA events around each decode step's graph run (input copies,
    pending-token fill, replay) during a real generate, against the interval between steps."""
    graphs = llm.engine.runner.graphs
    run = graphs.run
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event]] = []

    def timed_run(*args):
        start, replay = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run(*args[:-1], lambda ids: (args[-1](ids), replay.record()))
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        marks.append((start, replay, end))
        return out

    graphs.run = timed_run
    try:
        prompt = [[1000 + i for i in range(context)]]
        wall = wall_seconds(
            lambda: llm.generate(prompt, SamplingParams(max_tokens=steps, **GREEDY))
        )
    finally:
        graphs.run = run
    marks = marks[4:]  # steady state
    copies = statistics.median(a.elapsed_time(b) for a, b, _ in marks)
    replays = statistics.median(b.elapsed_time(c) for _, b, c in marks)
    intervals = statistics.median(
        marks[i][0].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)
    )
    print(
        f"in situ: copies+fill {copies * 1e3:.0f} us, replay {replays * 1e3:.0f} us, "
        f"step-to-step {intervals * 1e3:.0f} us; wall {wall / steps * 1e3:.3f} ms/token"
    )
    return {
        "in_situ_copies_us": copies * 1e3,
        "in_situ_replay_us": replays * 1e3,
        "in_situ_interval_us": intervals * 1e3,
    }


def gemv_variants(shapes: list[tuple[int, int]]) -> dict[str, float]:
    """One token through a bf16 weight [n, k]: F.linear (what the model called) against
    torch.mv and a transposed matmul, each timed inside a CUDA graph (no launch overhead)."""
    out = {}
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        variants = {
            "linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
            "mv": lambda x=x, w=w: torch.mv(w, x[0]),
            "matmul_t": lambda x=x, w=w: (w @ x.t()).t(),
        }
        line = []
        for name, fn in variants.items():
            seconds = graph_seconds_per_call(fn)
            out[f"gemv_{n}x{k}_{name}_us"] = seconds * 1e6
            line.append(
                f"{name} {seconds * 1e6:.1f} us ({w.numel() * 2 / seconds / 1e12:.2f} TB/s)"
            )
        print(f"[1 x {k}] @ [{k} x {n}]: " + ", ".join(line))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=LLAMA_8B)
    parser.add_argument("--context", type=int, default=160, help="tokens in the KV cache")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default="h200_decode_profile.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.decode_profile needs a CUDA GPU; skipped")
        return 0
    llm = bench_llm(args.model)
    # Leaves the batch-1 graph's input buffers holding a real decode step at ~context tokens.
    prompt = [[1000 + i for i in range(args.context)]]
    llm.generate(prompt, SamplingParams(max_tokens=4, **GREEDY))
    graph = llm.engine.runner.graphs.graphs[1]
    n = args.replays
    wall = best_seconds_per_call(graph.replay, iters=n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        synchronize()
    per_name: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name] += event.device_time / n  # us per step
            counts[event.name] += 1
    total = sum(per_name.values())
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, us in per_name.items():
        by_kind[kind_of(name)] += us
    print(f"graph replay {wall * 1e6:.0f} us; kernels {total:.0f} us; "
          f"{sum(counts.values()) // n} kernels per step")  # fmt: skip
    for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:25]:
        print(f"{us:9.1f} us  x{counts[name] // n:<4d} {name[:110]}")
    metrics = {
        "graph_replay_us": wall * 1e6,
        "kernel_time_us": total,
        "gap_us": wall * 1e6 - total,
        "kernels_per_step": sum(counts.values()) / n,
        **{f"{kind}_us": us for kind, us in sorted(by_kind.items())},
    }
    metrics.update(in_situ_steps(llm, args.context, 128))
    llm.engine.async_scheduling = False
    lock_step = in_situ_steps(llm, args.context, 128)
    metrics.update({f"lock_step_{k}": v for k, v in lock_step.items()})
    llm.engine.async_scheduling = True
    metrics.update(engine_timeline(llm, args.context, 64))
    shapes = projection_shapes(args.model)[:4]  # the decoder layer's four projections
    metrics.update(gemv_variants(shapes))
    print(metrics)
    write_result(args.out, "decode_profile", metrics, {}, workload={"model": args.model})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
