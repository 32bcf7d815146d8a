"""The LoRA kernels' tile and split settings swept at the cases that bound multi-LoRA serving
(H200, Llama-3.1-8B shapes, rank 16 on all seven projections, 64 slots): per-layer LoRA time in
a CUDA graph for each `LoRAKernelConfig` variant, each checked against the torch reference.

- 1 token: the fused GEMV (`fused_gemv_lora`) at several shrink split widths
  (`decode_k_per_split`), as time added to the plain GEMV's layer;
- 256 tokens on 64 and 8 adapters, the grouped pair: expand tile width (`group_block_n`) by
  expand programs (`expand_programs`), more tiles per program, the shrink's program target, its
  reduction block, 32-token blocks;
- 128, 64 and 8 tokens, the per-token pair: expand width by expand programs, split width.

    python -m benchmarks.lora_kernel_sweep          # writes results/h200_lora_kernel_sweep.json

Metrics: `<case>_<variant>_us` (LoRA per layer) and `..._max_rel_error`; for one token
`t1_fused_kps<k>_added_us`. The baseline is each case's default regime (`group`, `token`) and,
for one token, the plain GEMV's layer.
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


def fused_split_widths(bench: lk.Bench, metrics: dict, baseline: dict) -> None:
    """One token: the fused GEMV at each shrink split width against the plain GEMV."""
    from loraplex.kernels.gemv import linear
    from loraplex.kernels.lora import fused_gemv_lora

    bench.set_case(1, 1)
    meta, layers = bench.meta, bench.setup.num_layers
    counts = torch.zeros(layers, len(bench.weights), 1, dtype=torch.int32, device=bench.device)

    def step(config) -> None:
        counts.zero_()
        for i, per_layer in enumerate(bench.layers):
            for p, (layer, w, x) in enumerate(zip(per_layer, bench.weights, bench.xs)):
                if config is None:
                    linear(x, w, None)
                else:
                    fused_gemv_lora(x, w, None, layer, meta.kernel_meta, meta.workspace,
                                    counts[i, p], config)  # fmt: skip

    gemv_us = bench.timer.us(lambda: step(None), True, bench.setup.graph_iters) / layers
    baseline["t1_gemv_layer_us"] = gemv_us
    apply = bench.lora(lk.DEFAULT_KERNEL_CONFIG)
    for kps in SPLIT_WIDTHS:
        config = dataclasses.replace(lk.DEFAULT_KERNEL_CONFIG, decode_k_per_split=kps,
                                     decode_block_k=min(256, kps))  # fmt: skip
        err = 0.0
        for layer, w, x in zip(bench.layers[0], bench.weights, bench.xs):
            expected = linear(x, w, None)
            apply(layer, x, expected)
            counter = torch.zeros(1, dtype=torch.int32, device=bench.device)
            fused = fused_gemv_lora(x, w, None, layer, meta.kernel_meta, meta.workspace,
                                    counter, config)  # fmt: skip
            rel = (fused.float() - expected.float()).abs().max() / expected.float().abs().max()
            err = max(err, rel.item())
        us = bench.timer.us(lambda c=config: step(c), True, bench.setup.graph_iters) / layers
        metrics[f"t1_fused_kps{kps}_added_us"] = us - gemv_us
        metrics[f"t1_fused_kps{kps}_max_rel_error"] = err
        print(f"t1 fused, decode_k_per_split {kps}: +{us - gemv_us:.2f} us a layer, "
              f"error {err:.4f}", flush=True)  # fmt: skip


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
    fused_split_widths(bench, metrics, baseline)
    group, token = variants()
    sweep(bench, GROUP_CASES, group, "group", metrics, baseline)
    sweep(bench, TOKEN_CASES, token, "token", metrics, baseline)
    write_result(args.out, "lora_kernel_sweep", metrics, baseline)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
