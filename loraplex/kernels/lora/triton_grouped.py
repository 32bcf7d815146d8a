"""The grouped LoRA pair: tokens visited by slot segment (`LoRAKernelMeta`), `BLOCK_M` tokens of
one adapter per program, so they share weight loads and tensor-core tiles (S-LoRA / Punica's
segmented GEMM).

- shrink grid `(programs,)`: the step's blocks (block `i` is the i-th `BLOCK_M` run of one
  slot's tokens, read through `token_order`) times their reduction splits, as many splits as the
  programs fill (`group_splits`, found on the device from the slot counts, so that eight
  adapters' 16-token blocks split as wide as the GPU needs while 64 adapters' short blocks do
  not); each computes `x @ A^T` for every slice over its chunk of the input features with
  `tl.dot` and writes fp32 partials `[num_splits, num_tokens, width]`.
- expand grid `(blocks, column chunks)`: the block's summed partials (bf16 into the tensor
  cores, as Punica does) times the slot's `B^T` tiles across the chunk's columns, scaled, added
  into the tokens' output rows; a chunk spans several tiles (`expand_chunks`), so a program
  finds its tokens and sums the partials once for all of them.

One tile set serves decode batches of a few tokens per adapter and prefill steps alike (64-row
prefill tiles measured slower at 2,048 and 8,192 tokens). Programs past the last block exit at
once, so the grids depend on the token count only and replay from CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora.triton_common import (
    dora_args,
    dora_update,
    expand_chunks,
    group_block,
    group_scan,
    group_splits,
    offsets_tensor,
    pad,
    precision,
    sum_partials,
    tile_slice,
    warps,
)
from loraplex.kernels.lora.types import LoRAKernelConfig, LoRAKernelMeta, LoRAStack


@triton.jit(do_not_specialize=["num_tokens", "max_splits"])
def _shrink_group_kernel(
    x_ptr, a_ptr, t_ptr, order_ptr, start_ptr, count_ptr, rank_ptr,
    num_tokens, num_slots, K, max_splits,
    stride_xm, stride_as, stride_ar, stride_tm, stride_rs,
    MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, WIDTH_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    counts, blocks, ends = group_scan(count_ptr, num_slots, BLOCK_M, SLOTS)
    splits, k_per_split = group_splits(
        tl.sum(blocks, 0), tl.num_programs(0), K, max_splits, BLOCK_K
    )
    block = tl.program_id(0) // splits
    split = tl.program_id(0) % splits
    slot, pos0, pos_end = group_block(counts, blocks, ends, start_ptr, block, num_slots,
                                      BLOCK_M, SLOTS)  # fmt: skip
    if slot >= num_slots:
        return
    offs_m = pos0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < pos_end
    rows = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.arange(0, WIDTH_PAD)
    n_mask = offs_n < NUM_SLICES * MAX_RANK
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_n[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, WIDTH_PAD), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        a = tl.load(a_cols + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc += tl.dot(x, a, input_precision=PRECISION)
    ranks = tl.load(rank_ptr + (offs_n // MAX_RANK) * stride_rs + slot, mask=n_mask, other=0)
    acc = tl.where((offs_n % MAX_RANK < ranks)[None, :], acc, 0.0)
    t_rows = t_ptr + (split * num_tokens + rows) * stride_tm
    tl.store(t_rows[:, None] + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_tokens", "shrink_programs", "max_splits", "chunk_n"])
def _expand_group_kernel(
    t_ptr, b_ptr, out_ptr, order_ptr, start_ptr, count_ptr, rank_ptr, scaling_ptr, offsets_ptr,
    g_ptr, bias_ptr,
    num_tokens, num_slots, shrink_k, shrink_programs, max_splits, chunk_n,
    stride_tm, stride_bs, stride_br, stride_om, stride_rs, stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
    SLOTS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SHRINK_BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DORA: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    counts, blocks, ends = group_scan(count_ptr, num_slots, BLOCK_M, SLOTS)
    slot, pos0, pos_end = group_block(counts, blocks, ends, start_ptr, tl.program_id(0),
                                      num_slots, BLOCK_M, SLOTS)  # fmt: skip
    if slot >= num_slots:
        return
    num_splits, _ = group_splits(
        tl.sum(blocks, 0), shrink_programs, shrink_k, max_splits, SHRINK_BLOCK_K
    )
    slice_idx, chunk0, col_end = tile_slice(offsets_ptr, tl.program_id(1), chunk_n, NUM_SLICES)
    rank = tl.load(rank_ptr + slice_idx * stride_rs + slot)
    if rank == 0:
        return
    offs_m = pos0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < pos_end
    rows = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, RANK_PAD)
    r_mask = offs_r < rank
    t_ptrs = t_ptr + rows[:, None] * stride_tm + (slice_idx * MAX_RANK + offs_r)[None, :]
    t_mask = m_mask[:, None] & r_mask[None, :]
    t = sum_partials(t_ptrs, t_mask, num_splits, num_tokens * stride_tm, MAX_SPLITS)
    scaling = tl.load(scaling_ptr + slice_idx * stride_rs + slot)
    t = t.to(b_ptr.dtype.element_ty)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
    o_rows = out_ptr + rows[:, None] * stride_om
    g_row = g_ptr + slot.to(tl.int64) * stride_gs
    # NOTE: the tokens and their summed t are found once for up to `chunk_n` columns
    for col0 in range(chunk0, tl.minimum(chunk0 + chunk_n, col_end), BLOCK_N):
        offs_n = col0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_rows + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        mask = m_mask[:, None] & n_mask[None, :]
        cur = tl.load(o_rows + offs_n[None, :], mask=mask, other=0.0)
        acc = tl.dot(t, b, input_precision=PRECISION) * scaling
        new = dora_update(cur.to(tl.float32), acc, g_row + offs_n[None, :],
                          bias_ptr + offs_n[None, :], n_mask[None, :], DORA, HAS_BIAS)  # fmt: skip
        tl.store(o_rows + offs_n[None, :], new.to(cur.dtype), mask=mask)


def _grouping(num_tokens: int, num_slots: int, config: LoRAKernelConfig) -> tuple[int, int]:
    """(blocks of `group_block_m` tokens of one slot at most, slots padded) of a grouped grid."""
    blocks = triton.cdiv(num_tokens, config.group_block_m) + min(num_slots, num_tokens)
    return blocks, pad(num_slots)


def _shrink_plan(
    num_tokens: int, num_slots: int, workspace_rows: int, config: LoRAKernelConfig
) -> tuple[int, int]:
    """(programs, most splits) of a grouped shrink: about `target_programs` programs over the
    most blocks a step of `num_tokens` can have, each reduction split at most `max_splits` ways
    and into the workspace's rows. The kernel splits the step's real blocks over its programs,
    so a step of a few adapters' long blocks splits wider than one of many short ones."""
    blocks, _ = _grouping(num_tokens, num_slots, config)
    most = max(1, min(config.max_splits, workspace_rows // num_tokens))
    return blocks * min(triton.cdiv(config.target_programs, blocks), most), most


def shrink_grouped(
    x: torch.Tensor,  # [num_tokens, in]
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32
    config: LoRAKernelConfig,
) -> int:
    """Launch the grouped shrink; returns the most splits it may use (the expand's argument)."""
    num_tokens, k = x.shape
    num_slots = lora.a.shape[0]
    programs, most = _shrink_plan(num_tokens, num_slots, workspace.shape[0], config)
    width_pad = pad(lora.num_slices * lora.max_rank)
    bm, bk = config.group_block_m, config.shrink_block_k
    a, t = lora.a, workspace
    _shrink_group_kernel[(programs,)](
        x, a, t, meta.token_order, meta.slot_start, meta.slot_count, lora.ranks, num_tokens,
        num_slots, k, most,
        x.stride(0), a.stride(0), a.stride(1), t.stride(0), lora.ranks.stride(0),
        MAX_RANK=lora.max_rank, NUM_SLICES=lora.num_slices, SLOTS=pad(num_slots), BLOCK_M=bm,
        WIDTH_PAD=width_pad, BLOCK_K=bk, PRECISION=precision(x.dtype),
        num_warps=warps(max(bm, width_pad) * bk),
    )  # fmt: skip
    return most


def expand_grouped(
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32, the shrink's partials
    splits: int,  # what `shrink_grouped` returned
    out: torch.Tensor,  # [num_tokens, >= offsets[-1]]
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    config: LoRAKernelConfig,
) -> None:
    """Launch the grouped expand over the partials of `shrink_grouped` (it finds their count as
    the shrink did)."""
    num_tokens = out.shape[0]
    num_slots = lora.a.shape[0]
    bm, bn = config.group_block_m, config.group_block_n
    blocks, slots_pad = _grouping(num_tokens, num_slots, config)
    programs, _ = _shrink_plan(num_tokens, num_slots, workspace.shape[0], config)
    b_t, t = lora.b_t, workspace
    (g, bias), flags = dora_args(lora)
    chunk, chunks = expand_chunks(lora.slice_sizes, bn, triton.cdiv(num_tokens, bm), config)
    _expand_group_kernel[(blocks, chunks)](
        t, b_t, out, meta.token_order, meta.slot_start, meta.slot_count, lora.ranks,
        lora.scaling, offsets_tensor(lora.slice_offsets, out.device), g, bias, num_tokens,
        num_slots, lora.a.shape[2], programs, splits, chunk,
        t.stride(0), b_t.stride(0), b_t.stride(1), out.stride(0), lora.ranks.stride(0),
        g.stride(0),
        MAX_RANK=lora.max_rank, RANK_PAD=pad(lora.max_rank), NUM_SLICES=lora.num_slices,
        SLOTS=slots_pad, MAX_SPLITS=config.max_splits, BLOCK_M=bm, BLOCK_N=bn,
        SHRINK_BLOCK_K=config.shrink_block_k, PRECISION=precision(b_t.dtype),
        num_warps=warps(bm * bn), **flags,
    )  # fmt: skip
