"""Multi-LoRA cost per decoder layer against the layer's base projection GEMMs, on one GPU.

Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 32 query / 8 KV heads), bf16, rank 16,
64 slots. Per layer: the LoRA work of qkv, o, gate-up and down (one shrink and one expand each,
8 launches) against the four base GEMMs (cuBLAS). The LoRA weights of 32 layers are cycled, as in
a real forward, so they come from HBM rather than L2. For 1, 64 and 256 tokens spread over 1, 4
and 64 distinct adapters, it checks every kernel variant against the fp32 torch reference, times
each variant as a replayed CUDA graph, and times the default one eagerly too, plus the per-step
`LoRABatchMeta.set` (eager) and its token grouping (in a graph).

    python -m benchmarks.lora_kernels [--out h200_lora_kernels.json] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

import torch

from benchmarks.common.lora_layers import (
    MAX_LORAS,
    NUM_LAYERS,
    PROJECTIONS,
    RANK,
    build_layers,
    reference_delta,
)
from benchmarks.common.timing import event_seconds_per_call
from benchmarks.record import write_result
from loraplex.adapters.lora_layer import LoRABatchMeta, LoRALayer
from loraplex.kernels.lora import DEFAULT_KERNEL_CONFIG, LoRAKernelConfig, add_lora

CASES = ((1, 1), (64, 1), (64, 4), (64, 64), (256, 1), (256, 4), (256, 64))  # (tokens, adapters)
_D = DEFAULT_KERNEL_CONFIG
VARIANTS = {
    "default": _D,
    "token_kernels": dataclasses.replace(_D, token_kernels_max_tokens=1 << 20),
    "group_kernels": dataclasses.replace(_D, token_kernels_max_tokens=0),
    "group_bm32_bn256": dataclasses.replace(
        _D, token_kernels_max_tokens=0, group_block_m=32, group_block_n=256
    ),
    "expand_bn128": dataclasses.replace(_D, expand_block_n=128),
    "expand_bn512": dataclasses.replace(_D, expand_block_n=512),
    "shrink_bk64_splits64": dataclasses.replace(_D, shrink_block_k=64, max_splits=64),
    "programs_256": dataclasses.replace(_D, target_programs=256),
    "expand_chunks_1": dataclasses.replace(_D, group_expand_max_chunks=1),
    "expand_chunks_4": dataclasses.replace(_D, group_expand_max_chunks=4),
    "expand_chunks_8_always": dataclasses.replace(_D, group_expand_programs=1),
    "expand_programs_512": dataclasses.replace(_D, group_expand_programs=512),
    "expand_programs_2048": dataclasses.replace(_D, group_expand_programs=2048),
    "programs_1024": dataclasses.replace(_D, target_programs=1024),
}


def _us(fn: Callable[[], None], graph: bool, iters: int) -> float:
    """Mean microseconds per call, replayed from a CUDA graph or launched eagerly."""
    return event_seconds_per_call(fn, iters, warmup=2, graph=graph) * 1e6


_BIG_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def _workspace(name: str, meta: LoRABatchMeta) -> torch.Tensor:
    if not name.startswith("ws16k_"):
        return meta.workspace
    device = meta.workspace.device
    if device not in _BIG_WORKSPACE:
        _BIG_WORKSPACE[device] = torch.zeros(16384, meta.workspace.shape[1], device=device)
    return _BIG_WORKSPACE[device]


def _rel_error(
    layers: list[LoRALayer],
    xs: list[torch.Tensor],
    meta: LoRABatchMeta,
    config: LoRAKernelConfig,
    workspace: torch.Tensor,
) -> float:
    worst = 0.0
    for layer, x in zip(layers, xs):
        out = torch.zeros(x.shape[0], layer.offsets[-1], dtype=x.dtype, device=x.device)
        add_lora(x, out, layer.weights, meta.kernel_meta, workspace, config)
        ref = reference_delta(layer, x, meta)
        worst = max(worst, float((out.float() - ref).abs().max() / ref.abs().max()))
    return worst


def _measure(
    num_tokens: int,
    num_adapters: int,
    meta: LoRABatchMeta,
    layers: list[list[LoRALayer]],
    weights: list[torch.Tensor],
) -> dict[str, float | str]:
    """Per-layer numbers at one batch size: every variant in a graph, the default eagerly."""
    device, dtype = weights[0].device, weights[0].dtype
    slots = (torch.arange(num_tokens) % num_adapters).to(torch.int32)
    meta.set(slots)
    xs = [torch.randn(num_tokens, w.shape[1], device=device, dtype=dtype) for w in weights]
    outs = [torch.zeros(num_tokens, w.shape[0], device=device, dtype=dtype) for w in weights]

    def lora_step(config: LoRAKernelConfig, name: str = "default") -> Callable[[], None]:
        workspace = _workspace(name, meta)

        def step() -> None:
            for per_layer in layers:
                for layer, x, out in zip(per_layer, xs, outs):
                    add_lora(x, out, layer.weights, meta.kernel_meta, workspace, config)

        return step

    def base_step() -> None:
        for w, x, out in zip(weights, xs, outs):
            torch.matmul(x, w.T, out=out)

    row: dict[str, float | str] = {
        "base_gemm_us_graph": _us(base_step, graph=True, iters=100),
        "base_gemm_us_eager": _us(base_step, graph=False, iters=100),
        "lora_us_eager": _us(lora_step(_D), graph=False, iters=5) / NUM_LAYERS,
        "set_batch_us_eager": _us(lambda: meta.set(slots), graph=False, iters=100),
        "regroup_us_graph": _us(meta.regroup, graph=True, iters=100),
    }
    best = ("", float("inf"))
    for name, config in VARIANTS.items():
        row[f"{name}_max_rel_error"] = _rel_error(
            layers[0], xs, meta, config, _workspace(name, meta)
        )
        us = _us(lora_step(config, name), graph=True, iters=20) / NUM_LAYERS
        row[f"{name}_lora_us_graph"] = us
        if us < best[1] and row[f"{name}_max_rel_error"] < 2e-2:
            best = (name, us)
    row["lora_us_graph"] = row["default_lora_us_graph"]
    row["lora_over_base_graph"] = row["lora_us_graph"] / row["base_gemm_us_graph"]
    row["best_variant"] = best[0]
    row["best_lora_us_graph"] = best[1]
    row["best_over_base_graph"] = best[1] / row["base_gemm_us_graph"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


PROFILE_CASES = ((256, 1), (256, 64), (64, 64))


def profile(meta: LoRABatchMeta, layers: list[list[LoRALayer]]) -> dict[str, float]:
    """Device time per layer of each kernel (by name) of each projection, default config,
    launched eagerly under the torch profiler (kernel durations, no launch gaps)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out: dict[str, float] = {}
    device, dtype = meta.workspace.device, layers[0][0].weights.a.dtype
    for num_tokens, num_adapters in PROFILE_CASES:
        meta.set((torch.arange(num_tokens) % num_adapters).to(torch.int32))
        for p, name in enumerate(PROJECTIONS):
            x = torch.randn(num_tokens, layers[0][p].weights.a.shape[2], device=device, dtype=dtype)
            y = torch.zeros(num_tokens, layers[0][p].offsets[-1], device=device, dtype=dtype)
            for per_layer in layers:  # compile and warm
                add_lora(x, y, per_layer[p].weights, meta.kernel_meta, meta.workspace, _D)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for per_layer in layers:
                    add_lora(x, y, per_layer[p].weights, meta.kernel_meta, meta.workspace, _D)
                torch.cuda.synchronize()
            for event in prof.key_averages():
                us = event.self_device_time_total / NUM_LAYERS
                if us > 0:
                    key = f"profile_t{num_tokens}_a{num_adapters}_{name}_{event.key[:40]}_us"
                    out[key] = round(us, 2)
    return out


def measure_all(with_profile: bool = False) -> dict[str, float | str]:
    """Every case's per-layer figures (and each kernel's, with `with_profile`)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    meta, layers, weights = build_layers(device, dtype)
    metrics: dict[str, float | str] = {"launches_per_layer": 2 * len(PROJECTIONS)}
    for num_tokens, num_adapters in CASES:
        row = _measure(num_tokens, num_adapters, meta, layers, weights)
        metrics.update({f"t{num_tokens}_a{num_adapters}_{k}": v for k, v in row.items()})
    if with_profile:
        metrics.update(profile(meta, layers))
    return metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200_lora_kernels.json", help="in benchmarks/results/")
    parser.add_argument(
        "--profile", action="store_true", help="also each kernel's time per projection"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("lora_kernels: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    metrics = measure_all(args.profile)
    summary = {k: v for k, v in metrics.items() if "_default_" not in k and "rel_error" not in k}
    print(json.dumps(summary, indent=1))
    write_result(
        args.out,
        "lora_kernels",
        metrics,
        {"what": "the same layer's four base projection GEMMs (torch.matmul, cuBLAS, bf16)"},
        config={
            "shapes": "Llama-3.1-8B",
            "dtype": "bfloat16",
            "rank": RANK,
            "max_loras": MAX_LORAS,
            "lora_layers_cycled": NUM_LAYERS,
            "cases_tokens_adapters": CASES,
            "variants": {name: dataclasses.asdict(c) for name, c in VARIANTS.items()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
