"""One token through a W4A16 / W8A16 weight and its adapter in one launch: the fused tensor-core
kernel's product (`kernels.w4a16.triton_mma`) plus every slice's `scaling * (x @ A^T) @ B^T`
(DoRA: the column rescaled).

At batch 1 a quantized base reads a quarter of bf16's bytes, so the few microseconds of a
separate LoRA launch after each projection weigh four times as much (the decode kernel after
the W4A16 GEMM cost the AWQ base 1.43x its time per token on the H200). Here the GEMM's grid
carries the adapter, as `triton_gemv_lora` does for a plain weight:

- the first `NUM_SPLITS` programs are shrink items: a chunk of the input features -> its partial
  `t` of every slice into the workspace, then one count on the layer's counter;
- every later program is one (output tile, K split) program of the fused GEMM, in the GEMM's own
  order. Before its weight stream it loads what its rows need of the adapter (slice, rank,
  scaling, B rows; DoRA's column scale). The programs of split 0 then wait for the shrink
  items, sum their partials and add `scaling * t @ B^T` into their fp32 partial tile, which the
  split-K epilogue reduces with the others' as before: the delta is added in fp32 and rounded
  once with the product. DoRA: every split scales its partial by `g`, split 0 adds `g * delta`,
  and the epilogue adds the bias: `g * (x W^T + delta) + bias`.

The roles follow the program index (the GPU starts a grid's programs in index order, so the
shrink items run first; the polls are bounded, so a broken order shows as a wrong result, not a
hang), and the caller zeroes the counter before each launch (`LoRABatchMeta.set`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora.triton_common import (
    dora_args,
    offsets_tensor,
    pad,
    row_lora_delta,
    row_lora_operands,
    shrink_item,
    split_k,
)
from loraplex.kernels.lora.types import LoRAKernelConfig, LoRAKernelMeta, LoRAStack
from loraplex.kernels.split_k import split_k_workspace
from loraplex.kernels.triton_split_k import store_split_k_tile
from loraplex.kernels.w4a16 import W4A16Weight, mma_magic
from loraplex.kernels.w4a16.triton_mma import mma_tile
from loraplex.kernels.w4a16.types import FRAGMENT_LANES, TILE_K, W4A16Config, scale_dots

# NOTE: bounds the polls of the shrink counter (see `triton_gemv_lora`)
_MAX_POLLS = 1 << 16


@triton.jit(do_not_specialize=["tiles_per_split", "SPLIT_K"])
def _w4a16_lora_kernel(
    x_ptr, xw_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    a_ptr, b_ptr, t_ptr, count_ptr, slots_ptr, rank_ptr, scaling_ptr, offsets_ptr, g_ptr,
    N, K, tiles_per_split, k_per_split, num_tiles,
    stride_qn, stride_sg, stride_as, stride_ar, stride_bs, stride_br, stride_tm, stride_rs,
    stride_gs, SPLIT_K,
    GROUP_SIZE: tl.constexpr, SCALE_DOTS: tl.constexpr, BITS: tl.constexpr,
    MAGIC: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_ASM: tl.constexpr, SCALE_WEIGHTS: tl.constexpr,
    PREFETCH: tl.constexpr, TILE_K: tl.constexpr, LANES: tl.constexpr,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, WIDTH_PAD: tl.constexpr,
    NUM_SLICES: tl.constexpr, NUM_SPLITS: tl.constexpr, SHRINK_BLOCK_K: tl.constexpr,
    DORA: tl.constexpr, MAX_POLLS: tl.constexpr,
):  # fmt: skip
    """`x_ptr`: the token in input order (the shrink's); `xw_ptr`: in weight row order (the
    GEMM's; the same tensor without act-order)."""
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr)
    if pid < NUM_SPLITS:
        if slot >= 0:
            k_lo = pid * k_per_split
            shrink_item(x_ptr, a_ptr, rank_ptr, t_ptr + pid.to(tl.int64) * stride_tm, slot, k_lo,
                        tl.minimum(k_lo + k_per_split, K), stride_as, stride_ar, stride_rs,
                        MAX_RANK, NUM_SLICES, WIDTH_PAD, SHRINK_BLOCK_K)  # fmt: skip
        # NOTE: every thread's stores before one release: the barrier, then the counter
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release")
    else:
        flat = pid - NUM_SPLITS
        tile = flat % num_tiles
        split = flat // num_tiles
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < 1
        mask_n = offs_n < N
        # NOTE: before the weight stream, so their dependent loads hide behind it
        safe_slice, in_lora, r_mask, scaling, b = row_lora_operands(
            offsets_ptr, rank_ptr, scaling_ptr, b_ptr, offs_n, mask_n, slot, stride_rs,
            stride_bs, stride_br, NUM_SLICES, RANK_PAD)  # fmt: skip
        if DORA:
            g = tl.load(g_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_gs + offs_n,
                        mask=in_lora, other=1.0)  # fmt: skip
        acc = mma_tile(
            xw_ptr, qw_ptr, scales_ptr, zeros_ptr, offs_m, offs_n, mask_m, mask_n, K,
            split * tiles_per_split, tiles_per_split, 0, stride_qn, stride_sg, GROUP_SIZE,
            SCALE_DOTS, BITS, MAGIC, OFFSET, BLOCK_M, BLOCK_N, NUM_STAGES, DOT_PRECISION,
            USE_ASM, SCALE_WEIGHTS, PREFETCH, TILE_K, LANES,
        )  # fmt: skip  # [BLOCK_N, BLOCK_M], the token in column 0
        if (slot >= 0) & (split == 0):
            delta = row_lora_delta(t_ptr, count_ptr, safe_slice, r_mask, scaling, b, stride_tm,
                                   MAX_RANK, RANK_PAD, NUM_SPLITS, MAX_POLLS)  # fmt: skip
            acc += tl.where(offs_m[None, :] == 0, delta[:, None], 0.0)
        if DORA:
            acc = acc * g[:, None]
        store_split_k_tile(
            tl.trans(acc), offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr,
            lock_ptr, N, 0, HAS_BIAS, SPLIT_K,
        )  # fmt: skip


def w4a16_lora(
    x: torch.Tensor,  # [1, in]
    weight: W4A16Weight,
    bias: torch.Tensor | None,  # [N] or None; also DoRA's base bias
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32
    counter: torch.Tensor,  # [1] int32, zero before the launch; the shrink items count on it
    launch: W4A16Config,  # an "mma" kind with split_k resolved (`kernels.w4a16.mma_launch`)
    config: LoRAKernelConfig,
) -> torch.Tensor:  # [1, N] in x's dtype
    """The token's product through the packed weight and its adapter's delta in one launch
    (DoRA needs `bias` to be the stack's base bias)."""
    n, k = weight.shape
    if x.shape[0] != 1 or launch.kind == "dequant" or launch.split_k < 1:
        raise ValueError("lora: the fused W4A16 kernel takes one token and a resolved mma launch")
    if counter.shape != (1,) or counter.dtype != torch.int32:
        raise ValueError("lora: the fused W4A16 kernel's counter must be int32 [1]")
    if lora.dora_scale is not None and lora.base_bias is not bias:
        raise ValueError("lora: a DoRA stack's base bias must be the GEMM's bias")
    splits = min(triton.cdiv(k, config.decode_k_per_split), config.max_splits, workspace.shape[0])
    splits, k_per_split = split_k(k, splits, config.decode_block_k)
    xw = x if weight.perm is None else x.index_select(1, weight.perm)  # weight row order
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    k_tiles = triton.cdiv(k, TILE_K)
    tiles_per_split = triton.cdiv(k_tiles, launch.split_k)
    split = triton.cdiv(k_tiles, tiles_per_split)
    tiles = triton.cdiv(n, launch.block_n)
    ws, locks = split_k_workspace(x.device, n if split > 1 else 1, tiles)
    magic, offset = mma_magic(x.dtype, weight.bits)
    halves = weight.qweight.view(torch.int16)  # [N, 2 * K_pad / pack]
    a, b_t, t = lora.a, lora.b_t, workspace
    (g, _), flags = dora_args(lora)
    _w4a16_lora_kernel[(splits + tiles * split,)](
        x, xw, halves, weight.scales, weight.zeros, bias if bias is not None else weight.scales,
        out, ws, locks, a, b_t, t, counter, meta.lora_slots, lora.ranks, lora.scaling,
        offsets_tensor(lora.slice_offsets, x.device), g,
        n, k, tiles_per_split, k_per_split, tiles,
        halves.stride(0), weight.scales.stride(0), a.stride(0), a.stride(1), b_t.stride(0),
        b_t.stride(1), t.stride(0), lora.ranks.stride(0), g.stride(0), split,
        GROUP_SIZE=weight.group_size, SCALE_DOTS=scale_dots(weight.group_size, k, weight.bits),
        BITS=weight.bits, MAGIC=magic, OFFSET=offset, HAS_BIAS=bias is not None,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, NUM_STAGES=launch.num_stages,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_ASM=x.is_cuda and magic > 0, SCALE_WEIGHTS=launch.kind == "mma_wscale",
        PREFETCH=launch.prefetch, TILE_K=TILE_K, LANES=FRAGMENT_LANES,
        MAX_RANK=lora.max_rank, RANK_PAD=pad(lora.max_rank),
        WIDTH_PAD=pad(lora.num_slices * lora.max_rank), NUM_SLICES=lora.num_slices,
        NUM_SPLITS=splits, SHRINK_BLOCK_K=config.decode_block_k, DORA=flags["DORA"],
        MAX_POLLS=_MAX_POLLS, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return out
