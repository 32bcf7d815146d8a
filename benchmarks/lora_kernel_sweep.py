"""The LoRA kernels' tile and split settings swept at the cases that bound multi-LoRA serving
(H200, Llama-3.1-8B shapes, rank 16 on all seven projections, 64 slots): per-layer LoRA time in
a CUDA graph for each `LoRAKernelConfig` variant, each checked against the torch reference.

- 256 tokens on 64 and 8 adapters, the grouped pair: expand tile width (`group_block_n`) by
  expand programs (`expand_programs`), more tiles per program, the shrink's program target, its
  reduction block, 32-token blocks;
- 128, 64 and 8 tokens, the per-token pair: expand width by expand programs, split width.

    python -m benchmarks.lora_kernel_sweep          # writes results/h200_lora_kernel_sweep.json

Metrics: `<case>_<variant>_us` (LoRA per layer) and `..._max_rel_error`. The baseline is each
case's default regime (`group`, `token`). (Runs before 74eca34 also swept the fused batch-1
GEMV's shrink split width; its shrink has no split since.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

import benchmarks.lora_kernels as lk
from benchmarks.record import write_result

GROUP_CASES = ((256, 64), (256, 8))
TOKEN_CASES = ((128, 64), (64, 64), (8, 8))
SPLIT_WIDTHS = (256, 512, 1024, 2048, 4096)


def variants() -> tuple[dict, dict]:
    g, t = lk._GROUP, lk._TOKEN
    group = {"group": g}
    for bn in (64, 128, 256):
        for programs in (128, 256, 512, 1024):
            group[f"g_bn{bn}_p{programs}"] = dataclasses.replace(
                g, group_block_n=bn, expand_programs=programs
            )
    group["g_p128_t32"] = dataclasses.replace(g, expand_programs=128, expand_max_tiles=32)
    for target in (256, 1024, 2048):
        group[f"g_tp{target}"] = dataclasses.replace(g, target_programs=target)
    for bk in (64, 256):
        group[f"g_bk{bk}"] = dataclasses.replace(g, shrink_block_k=bk)
    group["g_bm32"] = dataclasses.replace(g, group_block_m=32)
    token = {"token": t}
    for bn in (128, 256, 512):
        for programs in (256, 1024):
            token[f"t_bn{bn}_p{programs}"] = dataclasses.replace(
                t, expand_block_n=bn, expand_programs=programs
            )
    for kps in (256, 1024):
        token[f"t_kps{kps}"] = dataclasses.replace(t, token_k_per_split=kps)
    return group, token


def sweep(bench: lk.Bench, cases, named: dict, default: str, metrics: dict, baseline: dict):
    lk.VARIANTS.update(named)
    for num_tokens, num_adapters in cases:
        bench.set_case(num_tokens, num_adapters)
        case = f"t{num_tokens}_a{num_adapters}"
        for name in named:
            err = bench.error(name)
            us = bench.timer.us(bench.lora_step(name), True, bench.setup.graph_iters)
            us /= bench.setup.num_layers
            target = baseline if name == default else metrics
            target[f"{case}_{name}_us"] = us
            metrics[f"{case}_{name}_max_rel_error"] = err
            print(f"{case} {name}: {us:.2f} us a layer, error {err:.4f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200_lora_kernel_sweep.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("lora_kernel_sweep: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    torch.manual_seed(0)
    bench = lk.Bench(lk.H200, torch.device("cuda"), torch.bfloat16)
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    group, token = variants()
    sweep(bench, GROUP_CASES, group, "group", metrics, baseline)
    sweep(bench, TOKEN_CASES, token, "token", metrics, baseline)
    write_result(args.out, "lora_kernel_sweep", metrics, baseline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
