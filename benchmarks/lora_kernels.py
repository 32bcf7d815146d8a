"""Multi-LoRA shrink+expand time per decoder layer against the layer's base projection GEMMs.

Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 32 query / 8 KV heads), bf16, rank 16,
`max_loras` 8 slots, tokens spread round-robin over up to 4 adapters. Per layer: the LoRA work
of qkv, o, gate-up and down (3 + 1 + 2 + 1 shards, each a shrink and an expand) versus the four
base GEMMs (`F.linear`, cuBLAS). Both are timed as replayed CUDA graphs, as decode runs them,
and eagerly (with launch overhead).

    python -m benchmarks.lora_kernels [--out benchmarks/results/lora_kernels.json]

(from the repository root, so that `loraplex` imports from the working tree).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.lora_layer import LoRABatchMeta, LoRALayer
from loraplex.kernels.lora import lora_expand_ref, lora_kernel_meta, lora_shrink_ref

HIDDEN, INTERMEDIATE, Q_SIZE, KV_SIZE = 4096, 14336, 4096, 1024
PROJECTIONS = {  # name: (input size, shard names, shard output sizes)
    "qkv_proj": (HIDDEN, ("q_proj", "k_proj", "v_proj"), [Q_SIZE, KV_SIZE, KV_SIZE]),
    "o_proj": (Q_SIZE, ("o_proj",), [HIDDEN]),
    "gate_up_proj": (HIDDEN, ("gate_proj", "up_proj"), [INTERMEDIATE, INTERMEDIATE]),
    "down_proj": (INTERMEDIATE, ("down_proj",), [HIDDEN]),
}
RANK, MAX_LORAS, NUM_ADAPTERS = 16, 8, 4
TOKEN_COUNTS = (1, 64, 256)


@dataclass
class _Target:
    prefix: str
    input_size: int
    output_sizes: list[int]
    shard_names: tuple[str, ...]
    lora: object = None

    def shard_offsets(self) -> list[int]:
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        return offsets


def _time_us(fn: Callable[[], None], graph: bool, iters: int = 200) -> float:
    """Mean microseconds per call, replayed from a CUDA graph or launched eagerly."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _check_against_reference(layer: LoRALayer, x: torch.Tensor, slots: torch.Tensor) -> float:
    """Largest relative error of the Triton path against the torch reference, one projection."""
    out = torch.zeros(x.shape[0], sum(layer.output_sizes), dtype=x.dtype, device=x.device)
    layer(x, out)
    meta = lora_kernel_meta(slots.cpu(), MAX_LORAS)
    ref = torch.zeros(out.shape, dtype=torch.float32)
    t = torch.zeros(x.shape[0], RANK)
    for i in range(len(layer.shard_names)):
        ranks, scaling = layer.ranks[i].cpu(), layer.scaling[i].cpu()
        lora_shrink_ref(x.cpu().float(), layer.a[i].cpu().float(), t, meta, ranks)
        lora_expand_ref(t, layer.b_t[i].cpu().float(), ref, layer.offsets[i], meta, ranks, scaling)
    return float((out.float().cpu() - ref).abs().max() / ref.abs().max())


def _measure(
    num_tokens: int, meta: LoRABatchMeta, layers: list[LoRALayer], weights: list[torch.Tensor]
) -> dict[str, float]:
    """Per-layer timings at one batch size, tokens spread over `NUM_ADAPTERS` slots."""
    device, dtype = weights[0].device, weights[0].dtype
    slots = (torch.arange(num_tokens, device=device) % NUM_ADAPTERS).to(torch.int32)
    meta.set(slots)
    xs = [torch.randn(num_tokens, w.shape[1], device=device, dtype=dtype) for w in weights]
    outs = [torch.zeros(num_tokens, w.shape[0], device=device, dtype=dtype) for w in weights]
    error = max(_check_against_reference(layer, x, slots) for layer, x in zip(layers, xs))

    def lora_layer_step() -> None:
        for layer, x, out in zip(layers, xs, outs):
            layer(x, out)

    def base_layer_step() -> None:
        for w, x, out in zip(weights, xs, outs):
            torch.matmul(x, w.T, out=out)

    row = {
        "lora_us_graph": _time_us(lora_layer_step, graph=True),
        "base_gemm_us_graph": _time_us(base_layer_step, graph=True),
        "lora_us_eager": _time_us(lora_layer_step, graph=False),
        "base_gemm_us_eager": _time_us(base_layer_step, graph=False),
        "set_batch_us_eager": _time_us(lambda: meta.set(slots), graph=False),
        "max_rel_error_vs_reference": error,
    }
    row["lora_over_base_graph"] = row["lora_us_graph"] / row["base_gemm_us_graph"]
    return {k: round(v, 4) for k, v in row.items()}


def run(out_path: Path) -> dict:
    """Measure every batch size and write the results JSON to `out_path`."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    meta = LoRABatchMeta(MAX_LORAS, RANK, max(TOKEN_COUNTS), device)
    layers, weights = [], []
    for name, (in_size, shards, sizes) in PROJECTIONS.items():
        target = _Target(f"model.layers.0.{name}", in_size, sizes, shards)
        layer = LoRALayer(target, 0, meta, RANK, device, dtype)
        for i in range(len(shards)):
            layer.a[i].normal_(std=in_size**-0.5)
            layer.b_t[i].normal_(std=RANK**-0.5)
            layer.ranks[i].fill_(RANK)
            layer.scaling[i].fill_(2.0)
        layers.append(layer)
        weights.append(torch.randn(sum(sizes), in_size, device=device, dtype=dtype) * in_size**-0.5)

    metrics = {f"tokens_{n}": _measure(n, meta, layers, weights) for n in TOKEN_COUNTS}
    result = {
        "benchmark": "lora_kernels",
        "device": torch.cuda.get_device_name(device),
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "shapes": "Llama-3.1-8B",
            "dtype": "bfloat16",
            "rank": RANK,
            "max_loras": MAX_LORAS,
            "adapters_in_batch": NUM_ADAPTERS,
            "per_layer": list(PROJECTIONS),
        },
        "metrics": metrics,
        "baseline": "the same layer's four base projection GEMMs (torch.matmul, cuBLAS, bf16)",
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_kernels.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("lora_kernels: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    result = run(args.out)
    print(json.dumps(result["metrics"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
