"""An experiment: the LoRA expand in the epilogue of a Triton base GEMM, against cuBLAS followed
by the default expand, for decode batches on the 8B shapes (one GPU).

At 64-256 tokens the default LoRA of a layer adds 2.5-5x its byte floor to the base GEMMs
(`lora_kernels`), and part of that floor is the expand's read-modify-write of the output. Here
one Triton GEMM computes `x @ W^T` for `BLOCK_M` tokens taken in slot order
(`LoRAKernelMeta.token_order`, so a tile holds the tokens of one or a few adapters) and, before
it stores the tile, adds `scaling * t @ B^T` of each slot present (one small `tl.dot` per slot
and tile), reading the shrink's partials; the output is written once. The shrink is the
default's (`shrink_lora`), before the GEMM in both variants.

For each case (tokens, adapters), per layer in a CUDA graph over 32 layers' adapters:
`cublas_us` (the four base GEMMs), `triton_us` (the Triton GEMM without LoRA, best of a few
tiles), `default_us` (cuBLAS, then the default LoRA), `fused_us` (shrink + the GEMM with the
expand in its epilogue, best tiles); each fused output is checked against cuBLAS + the default.

    python -m benchmarks.lora_gemm_epilogue [--out h200_lora_gemm_epilogue.json]
    python -m benchmarks.lora_gemm_epilogue --smoke   # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from benchmarks.lora_kernels import H200, SMOKE, Bench
from benchmarks.record import write_result
from loraplex.kernels.lora import DEFAULT_KERNEL_CONFIG, add_lora, lora_triton, shrink_lora
from loraplex.kernels.lora.triton_common import offsets_tensor, pad, sum_partials

CASES = ((64, 8), (128, 8), (256, 8), (256, 64))
SMOKE_CASES = ((5, 3),)
#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
TILES = ((64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (128, 128, 64, 8, 3), (32, 128, 128, 4, 4))
SMOKE_TILES = ((16, 16, 16, 4, 1),)


@triton.jit
def _gemm_lora_kernel(
    x_ptr, w_ptr, out_ptr, t_ptr, b_ptr, order_ptr, slots_ptr, rank_ptr, scaling_ptr,
    offsets_ptr, M, N, K, num_splits,
    stride_xm, stride_wn, stride_om, stride_tm, stride_bs, stride_br, stride_rs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
    MAX_SPLITS: tl.constexpr, LORA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_pid_m  # NOTE: the row tiles of one weight tile run side by side (L2)
    pid_n = pid // num_pid_m
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pos_ok = pos < M
    rows = tl.load(order_ptr + pos, mask=pos_ok, other=0).to(tl.int64)  # tokens, slot order
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=pos_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + cols[None, :] * stride_wn + offs_k[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
        acc = tl.dot(a, w, acc)
    if LORA:
        # the tile's slice (column tiles never straddle two slices here)
        slice_idx = 0
        for s in tl.static_range(NUM_SLICES):
            lo = tl.load(offsets_ptr + s)
            slice_idx = tl.where(pid_n * BLOCK_N >= lo, s, slice_idx)
        row_slot = tl.load(slots_ptr + rows, mask=pos_ok, other=-1)
        offs_r = tl.arange(0, RANK_PAD)
        t = sum_partials(t_ptr + rows[:, None] * stride_tm + slice_idx * MAX_RANK + offs_r[None, :],
                         pos_ok[:, None] & (offs_r < MAX_RANK)[None, :], num_splits,
                         M * stride_tm, MAX_SPLITS)  # fmt: skip  # [BLOCK_M, RANK_PAD]
        big = 1 << 30
        slot = tl.min(tl.where(row_slot >= 0, row_slot, big), 0)
        last = tl.max(row_slot, 0)
        while slot <= last:
            rank = tl.load(rank_ptr + slice_idx * stride_rs + slot)
            scaling = tl.load(scaling_ptr + slice_idx * stride_rs + slot)
            r_ok = offs_r < rank
            b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
                        + cols[None, :], mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            mine = tl.where((row_slot == slot)[:, None] & r_ok[None, :], t, 0.0)
            acc += tl.dot(mine.to(b.dtype), b) * scaling
            slot = tl.min(tl.where(row_slot > slot, row_slot, big), 0)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=pos_ok[:, None] & col_ok[None, :])  # fmt: skip


def gemm_lora(x, w, out, lora, meta, workspace, splits, tiles, with_lora=True) -> None:
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages = tiles
    b_t = lora.b_t
    _gemm_lora_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        x, w, out, workspace, b_t, meta.token_order, meta.lora_slots, lora.ranks, lora.scaling,
        offsets_tensor(lora.slice_offsets, x.device), m, n, k, splits,
        x.stride(0), w.stride(0), out.stride(0), workspace.stride(0), b_t.stride(0),
        b_t.stride(1), lora.ranks.stride(0),
        MAX_RANK=lora.max_rank, RANK_PAD=pad(lora.max_rank), NUM_SLICES=lora.num_slices,
        MAX_SPLITS=pad(DEFAULT_KERNEL_CONFIG.max_splits), LORA=with_lora, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def measure(bench: Bench, num_tokens: int, num_adapters: int, tiles_list) -> dict[str, float]:
    bench.set_case(num_tokens, num_adapters)
    meta, layers, iters = bench.meta, bench.setup.num_layers, bench.setup.graph_iters
    ws = meta.workspace
    run = add_lora if bench.cuda else lora_triton
    row: dict[str, float] = {}
    usable = []
    for tiles in tiles_list:
        err = 0.0
        for layer, w, x in zip(bench.layers[0], bench.weights, bench.xs):
            expected = (x.float() @ w.float().T).to(x.dtype)
            run(x, expected, layer, meta.kernel_meta, ws, DEFAULT_KERNEL_CONFIG, meta.counters)
            splits = shrink_lora(x, layer, meta.kernel_meta, ws)
            out = torch.empty_like(expected)
            gemm_lora(x, w, out, layer, meta.kernel_meta, ws, splits, tiles)
            scale = expected.float().abs().max()
            err = max(err, ((out.float() - expected.float()).abs().max() / scale).item())
        row[f"fused_{'x'.join(map(str, tiles))}_max_rel_error"] = round(err, 4)
        if err < 2e-2:
            usable.append(tiles)
    if not bench.cuda:
        return row

    def step(mode: str, tiles=None):
        def fn() -> None:
            for per_layer in bench.layers:
                for layer, w, x, out in zip(per_layer, bench.weights, bench.xs, bench.outs):
                    if mode in ("cublas", "default"):
                        torch.matmul(x, w.T, out=out)
                        if mode == "default":
                            add_lora(x, out, layer, meta.kernel_meta, ws,
                                     counters=meta.counters)  # fmt: skip
                    elif mode == "triton":
                        gemm_lora(x, w, out, layer, meta.kernel_meta, ws, 1, tiles, False)
                    else:
                        splits = shrink_lora(x, layer, meta.kernel_meta, ws)
                        gemm_lora(x, w, out, layer, meta.kernel_meta, ws, splits, tiles)

        return fn

    timer = bench.timer
    row["cublas_us"] = timer.us(step("cublas"), True, iters) / layers
    row["default_us"] = timer.us(step("default"), True, iters) / layers
    for mode in ("triton", "fused"):
        best = None
        for tiles in usable:
            us = timer.us(step(mode, tiles), True, iters) / layers
            row[f"{mode}_{'x'.join(map(str, tiles))}_us"] = round(us, 3)
            best = us if best is None else min(best, us)
        if best is not None:
            row[f"{mode}_us"] = best
    if "fused_us" in row:
        row["default_added_us"] = row["default_us"] - row["cublas_us"]
        row["fused_added_us"] = row["fused_us"] - row["cublas_us"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="h200_lora_gemm_epilogue.json")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    args = parser.parse_args()
    if args.smoke:
        setup, device, cases, tiles = SMOKE, torch.device("cpu"), SMOKE_CASES, SMOKE_TILES
    elif not torch.cuda.is_available():
        print("lora_gemm_epilogue: no CUDA device; nothing to measure", file=sys.stderr)
        return 0
    else:
        setup, device, cases, tiles = H200, torch.device("cuda"), CASES, TILES
    torch.manual_seed(0)
    bench = Bench(setup, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    metrics: dict[str, float] = {}
    for num_tokens, num_adapters in cases:
        row = measure(bench, num_tokens, num_adapters, tiles)
        print(f"t{num_tokens} a{num_adapters}: "
              f"{ {k: v for k, v in row.items() if not k.startswith(('fused_', 'triton_')) or k in ('fused_us', 'triton_us', 'fused_added_us')} }",
              flush=True)  # fmt: skip
        metrics.update({f"t{num_tokens}_a{num_adapters}_{k}": v for k, v in row.items()})
        if not args.smoke:
            write_result(args.out, "lora_gemm_epilogue", metrics,
                         {"default": "cuBLAS then the default LoRA (add_lora), same run"},
                         config={"tiles": TILES, "cases": CASES})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
