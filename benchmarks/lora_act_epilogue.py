# ruff: noqa: B023, B007  (the timed closures run within the iteration that made them)
"""The gate-up LoRA expand with SiLU-and-mul as its epilogue against the expand then the
activation kernel, per layer on the H200 (Llama-3.1-8B gate-up, rank 16, 32 layers cycled, CUDA
graphs), at a few token / adapter counts and tile variants; checks the two agree bit for bit.
Kept for the record at the commit of results/h200_lora_act_epilogue.json (the fused kernel lost
and left the tree after it).

    python -m benchmarks.lora_act_epilogue
"""

import dataclasses

import torch

import benchmarks.common.lora_layers as L
from benchmarks.common.lora_layers import build_layers
from loraplex.kernels.lora import DEFAULT_KERNEL_CONFIG as C
from loraplex.kernels.lora import expand_lora, shrink_lora
from loraplex.kernels.lora.triton_grouped import expand_grouped_silu_and_mul
from loraplex.kernels.triton_activation import silu_and_mul_triton

dev = torch.device("cuda")
L.MAX_TOKENS = 2048
meta, layers, weights = build_layers(dev, torch.bfloat16)
gu = [per[2] for per in layers]  # gate_up LoRALayers, 32 layers


def timeit(fn, iters=20):
    g = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(iters):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / iters / len(gu)


for n, a in [(256, 64), (256, 8), (256, 1), (512, 64), (2048, 8)]:
    meta.set((torch.arange(n) % a).to(torch.int32).to(dev))
    x = torch.randn(n, 4096, device=dev, dtype=torch.bfloat16)
    out = torch.randn(n, 28672, device=dev, dtype=torch.bfloat16)
    for cfg_name, cfg in [
        ("default", C),
        ("bn64", dataclasses.replace(C, group_block_n=64)),
        ("p512", dataclasses.replace(C, expand_programs=512)),
        ("p128", dataclasses.replace(C, expand_programs=128)),
    ]:
        splits = shrink_lora(x, gu[0].weights, meta.kernel_meta, meta.workspace, cfg)

        def sep():
            for hook in gu:
                expand_lora(meta.workspace, splits, out, hook.weights, meta.kernel_meta, cfg)
                silu_and_mul_triton(out)

        def fused():
            for hook in gu:
                expand_grouped_silu_and_mul(
                    meta.workspace, splits, out, hook.weights, meta.kernel_meta, cfg
                )

        def act_only():
            for hook in gu:
                silu_and_mul_triton(out)

        o1 = out.clone()
        expand_lora(meta.workspace, splits, o1, gu[0].weights, meta.kernel_meta, cfg)
        r1 = silu_and_mul_triton(o1)
        r2 = expand_grouped_silu_and_mul(
            meta.workspace, splits, out.clone(), gu[0].weights, meta.kernel_meta, cfg
        )
        err = (r1.float() - r2.float()).abs().max().item()
        print(
            f"t{n} a{a} {cfg_name}: separate {timeit(sep):.1f} us, fused {timeit(fused):.1f} us, act alone {timeit(act_only):.1f} us, max diff {err:.3g}, equal frac {(r1 == r2).float().mean().item():.4f}",
            flush=True,
        )
