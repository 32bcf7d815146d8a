"""The one-launch LoRA of a decode batch: shrink and expand of every slice in a single kernel.

At a few tokens the LoRA work of a `Linear` is a few hundred kilobytes; two launches (shrink,
then expand) cost more than the bytes, and one program redoing the whole shrink per output tile
re-reads its slice's A (the fused kernel measured 2x slower than the pair on the H200). Here the
work is split into items, handed out in arrival order:

- `num_tokens * num_splits` shrink items: (token, chunk of the input features) -> that chunk's
  partial `t` row of every slice, written to its own workspace block
  (`[num_splits, num_tokens, width]`), then one count on the shrink counter;
- `num_tokens * column tiles` expand items: (token, tile) -> wait until every shrink item has
  counted, sum the token's partials, add `scaling * t @ B^T` into the tile (DoRA: rescale).

Every program first takes a ticket (an atomic counter): tickets below the shrink count are
shrink items. A program waits only on items whose tickets were handed out before its own,
i.e. to programs already running, so the launch cannot deadlock however many programs fit on
the GPU; under the Triton interpreter (one program after another, in order) no program ever
waits. The last expand item resets the counters for the next launch, so a CUDA graph replays
it as is. With `decode_pdl` the kernel is launched as a programmatic dependent of the launch
before it (the base GEMM): the shrink items overlap that GEMM's tail and every expand item
waits for it (`griddepcontrol.wait`) before it reads the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora.triton_common import (
    column_tiles,
    dora_args,
    dora_update,
    offsets_tensor,
    pad,
    shrink_item,
    split_k,
    sum_token_partials,
    tile_slice,
    warps,
)
from loraplex.kernels.lora.types import SYNC_COUNTERS, LoRAKernelConfig, LoRAKernelMeta, LoRAStack

try:  # Triton >= 3.3 on CUDA: programmatic dependent launch
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # pragma: no cover - older Triton: decode_pdl cannot be set
    gdc_wait = None

# NOTE: a bound on the polls of the shrink counter, so that a broken counter shows as a wrong
# result (the benchmarks and GPU tests compare against the reference) instead of a hang; the
# shrink items finish within microseconds, ~1000x fewer polls.
_MAX_POLLS = 1 << 16


@triton.jit(do_not_specialize=["num_tokens", "num_splits", "num_tiles"])
def _decode_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, t_ptr, sync_ptr, slots_ptr, rank_ptr, scaling_ptr,
    offsets_ptr, g_ptr, bias_ptr,
    num_tokens, K, k_per_split, num_splits, num_tiles,
    stride_xm, stride_as, stride_ar, stride_bs, stride_br, stride_om, stride_tm, stride_rs,
    stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, WIDTH_PAD: tl.constexpr,
    NUM_SLICES: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_POLLS: tl.constexpr, DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    num_shrink = num_tokens * num_splits
    ticket = tl.atomic_add(sync_ptr, 1)
    if ticket < num_shrink:
        tok = ticket // num_splits
        split = ticket % num_splits
        slot = tl.load(slots_ptr + tok)
        if slot >= 0:
            k_lo = split * k_per_split
            shrink_item(x_ptr + tok.to(tl.int64) * stride_xm, a_ptr, rank_ptr,
                        t_ptr + (split * num_tokens + tok).to(tl.int64) * stride_tm, slot, k_lo,
                        tl.minimum(k_lo + k_per_split, K), stride_as, stride_ar, stride_rs,
                        MAX_RANK, NUM_SLICES, WIDTH_PAD, BLOCK_K)  # fmt: skip
        # NOTE: every thread's stores before one release: the barrier, then the counter
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        item = ticket - num_shrink
        tok = item // num_tiles
        slot = tl.load(slots_ptr + tok)
        slice_idx, col0, col_end = tile_slice(offsets_ptr, item % num_tiles, BLOCK_N, NUM_SLICES)
        offs_r = tl.arange(0, RANK_PAD)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        safe_slot = tl.maximum(slot, 0).to(tl.int64)
        b = tl.load(
            b_ptr + safe_slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
            mask=(offs_r < MAX_RANK)[:, None] & n_mask[None, :], other=0.0,
        )  # fmt: skip
        rank = tl.load(rank_ptr + slice_idx * stride_rs + safe_slot)
        done = tl.load(sync_ptr + 1, volatile=True)
        polls = 0
        while (done < num_shrink) & (polls < MAX_POLLS):
            done = tl.load(sync_ptr + 1, volatile=True)
            polls += 1
        # NOTE: an acquire read orders the shrinks' stores before the loads of t; its value
        # gates those loads, so the compiler keeps it
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        tl.debug_barrier()
        if (slot >= 0) & (rank > 0):
            r_mask = offs_r < rank
            used = tl.where(done >= num_shrink, num_splits, 0)
            t = sum_token_partials(t_ptr, tok, num_tokens, used, stride_tm,
                                   slice_idx * MAX_RANK, r_mask, SPLITS_PAD, RANK_PAD)  # fmt: skip
            b32 = tl.where(r_mask[:, None], b.to(tl.float32), 0.0)
            delta = tl.sum(t[:, None] * b32, 0) * tl.load(
                scaling_ptr + slice_idx * stride_rs + slot
            )
            if USE_PDL:
                gdc_wait()
            o_ptrs = out_ptr + tok.to(tl.int64) * stride_om + offs_n
            cur = tl.load(o_ptrs, mask=n_mask, other=0.0)
            g_ptrs = g_ptr + safe_slot * stride_gs + offs_n
            new = dora_update(cur.to(tl.float32), delta, g_ptrs, bias_ptr + offs_n, n_mask,
                              DORA, HAS_BIAS)  # fmt: skip
            tl.store(o_ptrs, new.to(cur.dtype), mask=n_mask)
        finished = tl.atomic_add(sync_ptr + 2, 1)
        if finished == num_tokens * num_tiles - 1:  # the last program of the launch
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)
            tl.atomic_xchg(sync_ptr + 2, 0)


def decode_splits(k: int, num_tokens: int, workspace_rows: int, config: LoRAKernelConfig):
    """(splits, input features per split) of the decode kernel's shrink items: by the input size
    alone, within the workspace's rows."""
    splits = min(triton.cdiv(k, config.decode_k_per_split), config.max_splits)
    return split_k(k, min(splits, max(1, workspace_rows // num_tokens)), config.decode_block_k)


def lora_decode(
    x: torch.Tensor,  # [num_tokens, in]
    out: torch.Tensor,  # [num_tokens, >= offsets[-1]]
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32
    counters: torch.Tensor,  # [SYNC_COUNTERS] int32, zero; zero again when the launch ends
    config: LoRAKernelConfig,
) -> None:
    """Every token's delta of every slice into `out`, in one launch."""
    num_tokens, k = x.shape
    if counters.shape != (SYNC_COUNTERS,) or counters.dtype != torch.int32:
        raise ValueError(f"lora: counters must be int32 [{SYNC_COUNTERS}]")
    splits, k_per_split = decode_splits(k, num_tokens, workspace.shape[0], config)
    tiles = column_tiles(lora.slice_sizes, config.decode_block_n)
    width_pad = pad(lora.num_slices * lora.max_rank)
    a, b_t, t = lora.a, lora.b_t, workspace
    (g, bias), flags = dora_args(lora)
    use_pdl = config.decode_pdl and x.is_cuda
    launch = {"launch_pdl": True} if use_pdl else {}
    _decode_kernel[(num_tokens * (splits + tiles),)](
        x, a, b_t, out, t, counters, meta.lora_slots, lora.ranks, lora.scaling,
        offsets_tensor(lora.slice_offsets, x.device), g, bias,
        num_tokens, k, k_per_split, splits, tiles,
        x.stride(0), a.stride(0), a.stride(1), b_t.stride(0), b_t.stride(1), out.stride(0),
        t.stride(0), lora.ranks.stride(0), g.stride(0),
        MAX_RANK=lora.max_rank, RANK_PAD=pad(lora.max_rank), WIDTH_PAD=width_pad,
        NUM_SLICES=lora.num_slices, SPLITS_PAD=pad(config.max_splits),
        BLOCK_K=config.decode_block_k, BLOCK_N=config.decode_block_n, MAX_POLLS=_MAX_POLLS,
        USE_PDL=use_pdl, num_warps=warps(max(width_pad * config.decode_block_k,
                                             pad(lora.max_rank) * config.decode_block_n)),
        **flags, **launch,
    )  # fmt: skip
