"""The fused shrink+expand LoRA launch against the shrink + expand pair, per projection, on one
GPU: Llama-3.1-8B shapes, bf16, rank 16, 64 slots, 32 layers' weights cycled (from HBM, as in a
forward), batches of 1, 8 and 64 tokens each on its own adapter.

Paths: `fused` (forced on every projection), `two_kernels` (the pair), `default` (what serving
runs: `LoRAKernelConfig()`, fused up to `fused_max_tokens` tokens on inputs up to `fused_max_k`;
the record says which). First a check: every projection, every path, against the fp32 torch
reference with mixed ranks (1..16, a zero-rank shard) and base-model rows (slot -1); a failure
stops the run. Then each path's time per layer and per projection, replayed from a CUDA graph. No sampling is involved
(kernels only), so there is no greedy / temperature / mixed split here: `benchmarks.multi_lora`
measures those end to end.

    python -m benchmarks.lora_fused [--out h200_lora_fused.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from benchmarks.common.lora_layers import (
    NUM_LAYERS,
    PROJECTIONS,
    RANK,
    build_layers,
    reference_delta,
)
from benchmarks.common.timing import event_seconds_per_call
from benchmarks.record import write_result
from loraplex.kernels.lora import DEFAULT_KERNEL_CONFIG, LoRAKernelConfig, add_lora

BATCHES = (1, 8, 64)
PATHS = {
    "fused": dataclasses.replace(
        DEFAULT_KERNEL_CONFIG, fused_max_tokens=1 << 20, fused_max_k=1 << 30
    ),  # fmt: skip
    "two_kernels": dataclasses.replace(DEFAULT_KERNEL_CONFIG, fused_max_tokens=0),
    "default": DEFAULT_KERNEL_CONFIG,
}
TOLERANCE = 2e-2  # max |error| / max |reference| in bf16


def _check(meta, layers, device) -> dict[str, float]:
    """Both paths against the fp32 reference on mixed ranks and base rows; raises on a miss."""
    errors = {}
    gen = torch.Generator().manual_seed(1)
    for num_tokens in BATCHES:
        slots = torch.randint(-1, 64, (num_tokens,), generator=gen, dtype=torch.int32)
        slots[0] = 3
        meta.set(slots.to(device))
        for layer in layers[0]:
            w = layer.weights
            saved = w.ranks.clone()
            w.ranks.copy_(torch.randint(1, RANK + 1, w.ranks.shape, generator=gen))
            if w.num_slices > 1:
                w.ranks[-1, 3] = 0  # a shard the adapter does not touch
            x = torch.randn(num_tokens, layer.input_size, device=device, dtype=w.a.dtype)
            ref = reference_delta(layer, x, meta)
            for name, config in PATHS.items():
                out = torch.zeros(num_tokens, layer.offsets[-1], device=device, dtype=x.dtype)
                add_lora(x, out, w, meta.kernel_meta, meta.workspace, config)
                err = float((out.float() - ref).abs().max() / ref.abs().max())  # NaN fails
                base_rows = (slots < 0).to(device)
                if not err <= TOLERANCE or bool((out[base_rows] != 0).any()):
                    raise AssertionError(f"{name} {layer.prefix} t{num_tokens}: error {err}")
                key = f"t{num_tokens}_{name}_max_rel_error"
                errors[key] = max(errors.get(key, 0.0), round(err, 5))
            w.ranks.copy_(saved)
    return errors


def _step(meta, layers, xs, outs, config: LoRAKernelConfig, only: int | None = None):
    """Every layer's LoRA of every projection (or of projection `only`), in one call."""

    def run() -> None:
        for per_layer in layers:
            for i, (layer, x, out) in enumerate(zip(per_layer, xs, outs)):
                if only is None or i == only:
                    add_lora(x, out, layer.weights, meta.kernel_meta, meta.workspace, config)

    return run


def _us_per_layer(step) -> float:
    """Microseconds per layer of one `_step` call, replayed from a CUDA graph."""
    return event_seconds_per_call(step, iters=20, warmup=2, graph=True) * 1e6 / NUM_LAYERS


def _timings(meta, layers, device) -> dict[str, float]:
    """Each path's microseconds per layer and per projection, at each batch size."""
    dtype = layers[0][0].weights.a.dtype
    metrics: dict[str, float] = {}
    for num_tokens in BATCHES:
        meta.set((torch.arange(num_tokens) % 64).to(torch.int32).to(device))
        xs = [
            torch.randn(num_tokens, p[0], device=device, dtype=dtype) for p in PROJECTIONS.values()
        ]
        outs = [torch.zeros(num_tokens, sum(p[2]), device=device, dtype=dtype)
                for p in PROJECTIONS.values()]  # fmt: skip

        for name, config in PATHS.items():
            us = _us_per_layer(_step(meta, layers, xs, outs, config))
            metrics[f"t{num_tokens}_{name}_us_per_layer"] = round(us, 3)
            for i, proj in enumerate(PROJECTIONS):
                us = _us_per_layer(_step(meta, layers, xs, outs, config, i))
                metrics[f"t{num_tokens}_{name}_{proj}_us"] = round(us, 3)
        metrics[f"t{num_tokens}_fused_over_two_kernels"] = round(
            metrics[f"t{num_tokens}_fused_us_per_layer"]
            / metrics[f"t{num_tokens}_two_kernels_us_per_layer"],
            4,
        )
        print({k: v for k, v in metrics.items() if k.startswith(f"t{num_tokens}_")})
    return metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200_lora_fused.json", help="in benchmarks/results/")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("lora_fused: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    device = torch.device("cuda")
    torch.manual_seed(0)
    meta, layers, _ = build_layers(device, torch.bfloat16)
    metrics = _check(meta, layers, device)
    print("check passed:", metrics)
    metrics.update(_timings(meta, layers, device))
    write_result(
        args.out, "lora_fused", metrics,
        {"paths": "two_kernels = the shrink + expand pair (token kernels up to 64 tokens)"},
        config={"shapes": "Llama-3.1-8B", "dtype": "bfloat16", "rank": RANK, "max_loras": 64,
                "layers_cycled": NUM_LAYERS, "batches": BATCHES,
                "fused_max_tokens_default": DEFAULT_KERNEL_CONFIG.fused_max_tokens,
                "fused_max_k_default": DEFAULT_KERNEL_CONFIG.fused_max_k},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
