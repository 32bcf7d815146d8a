"""Where the GPU time of one batch-1 decode step goes: the kernels of the captured CUDA graph,
summed by name, against the graph's wall time (the gap is launch and idle time inside it).

    python -m benchmarks.decode_profile [--model configs/models/llama-3.1-8b.json]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_path import GREEDY, cuda_timed
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="configs/models/llama-3.1-8b.json")
    parser.add_argument("--context", type=int, default=160, help="tokens in the KV cache")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default="h200_decode_profile.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.decode_profile needs a CUDA GPU; skipped")
        return 0
    llm = LLM(
        args.model,
        dtype="bfloat16",
        enable_lora=False,
        max_model_len=4096,
        gpu_memory_utilization=0.55,
        seed=0,
    )
    # Leaves the batch-1 graph's input buffers holding a real decode step at ~context tokens.
    prompt = [[1000 + i for i in range(args.context)]]
    llm.generate(prompt, SamplingParams(max_tokens=4, **GREEDY))
    graph = llm.engine.runner.graphs.graphs[1]
    n = args.replays
    wall = min(cuda_timed(lambda: [graph.replay() for _ in range(n)]) for _ in range(3)) / n
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
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
    print(metrics)
    write_result(args.out, "decode_profile", metrics, {}, workload={"model": args.model})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
