"""The per-token LoRA pair: a shrink and an expand launch, one token per program.

- shrink grid `(num_tokens, num_splits)`: program (token, split) computes every slice's
  `x @ A^T` over its chunk of the input features (fp32, a GEMV on CUDA cores) and writes the
  partial `t` row to its own workspace block (`[num_splits, num_tokens, num_slices * max_rank]`):
  no memset, no atomics.
- expand grid `(num_tokens, column chunks)`: chunk `j` maps to `(slice, columns)` through the
  slice offsets; the program sums its token's partials once (every load in flight at once), then
  for each `B^T` tile of the chunk multiplies, scales and adds into `out` (DoRA: rescales the
  column).

Tokens on different adapters share nothing here, which suits decode batches where most tokens
carry their own adapter. The split count depends on the input size only (`token_k_per_split`),
so the compiled kernels do not depend on the batch size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora.triton_common import (
    dora_args,
    dora_update,
    expand_chunks,
    offsets_tensor,
    pad,
    split_k,
    sum_token_partials,
    tile_slice,
    warps,
)
from loraplex.kernels.lora.types import LoRAKernelConfig, LoRAKernelMeta, LoRAStack


@triton.jit(do_not_specialize=["num_tokens"])
def _shrink_token_kernel(
    x_ptr, a_ptr, t_ptr, slots_ptr, rank_ptr,
    num_tokens, K, k_per_split,
    stride_xm, stride_as, stride_ar, stride_tm, stride_rs,
    MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr, WIDTH_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr + tok)
    if slot < 0:
        return
    offs_n = tl.arange(0, WIDTH_PAD)  # t column: slice * MAX_RANK + r
    n_mask = offs_n < NUM_SLICES * MAX_RANK
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_n[:, None] * stride_ar
    x_row = x_ptr + tok.to(tl.int64) * stride_xm
    acc = tl.zeros((WIDTH_PAD, BLOCK_K), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    # NOTE: the rank masks the result, not the loads, so A's loads need not wait for it
    ranks = tl.load(rank_ptr + (offs_n // MAX_RANK) * stride_rs + slot, mask=n_mask, other=0)
    t = tl.where(offs_n % MAX_RANK < ranks, tl.sum(acc, 1), 0.0)
    t_row = t_ptr + (split * num_tokens + tok).to(tl.int64) * stride_tm
    tl.store(t_row + offs_n, t, mask=n_mask)


@triton.jit(do_not_specialize=["num_tokens", "num_splits", "chunk_n"])
def _expand_token_kernel(
    t_ptr, b_ptr, out_ptr, slots_ptr, rank_ptr, scaling_ptr, offsets_ptr, g_ptr, bias_ptr,
    num_tokens, num_splits, chunk_n,
    stride_tm, stride_bs, stride_br, stride_om, stride_rs, stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
    SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    slot = tl.load(slots_ptr + tok)
    if slot < 0:
        return
    slice_idx, chunk0, col_end = tile_slice(offsets_ptr, tl.program_id(1), chunk_n, NUM_SLICES)
    rank = tl.load(rank_ptr + slice_idx * stride_rs + slot)
    if rank == 0:
        return
    offs_r = tl.arange(0, RANK_PAD)
    r_mask = offs_r < rank
    t = sum_token_partials(t_ptr, tok, num_tokens, num_splits, stride_tm, slice_idx * MAX_RANK,
                           r_mask, SPLITS_PAD, RANK_PAD)  # fmt: skip
    scaling = tl.load(scaling_ptr + slice_idx * stride_rs + slot)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
    o_row = out_ptr + tok.to(tl.int64) * stride_om
    g_row = g_ptr + slot.to(tl.int64) * stride_gs
    # NOTE: the token's summed t is found once for up to `chunk_n` columns
    for col0 in range(chunk0, tl.minimum(chunk0 + chunk_n, col_end), BLOCK_N):
        offs_n = col0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_rows + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        cur = tl.load(o_row + offs_n, mask=n_mask, other=0.0)
        delta = tl.sum(t[:, None] * b.to(tl.float32), 0) * scaling
        new = dora_update(cur.to(tl.float32), delta, g_row + offs_n, bias_ptr + offs_n, n_mask,
                          DORA, HAS_BIAS)  # fmt: skip
        tl.store(o_row + offs_n, new.to(cur.dtype), mask=n_mask)


def token_splits(k: int, workspace_rows: int, num_tokens: int, config: LoRAKernelConfig):
    """(splits, input features per split) of the per-token shrink: by the input size alone,
    within the workspace's rows."""
    splits = min(triton.cdiv(k, config.token_k_per_split), config.max_splits)
    return split_k(k, min(splits, max(1, workspace_rows // num_tokens)), config.shrink_block_k)


def shrink_tokens(
    x: torch.Tensor,  # [num_tokens, in]
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32
    config: LoRAKernelConfig,
) -> int:
    """Launch the per-token shrink; returns its split count (the expand's argument)."""
    num_tokens, k = x.shape
    splits, k_per_split = token_splits(k, workspace.shape[0], num_tokens, config)
    width_pad = pad(lora.num_slices * lora.max_rank)
    a, t = lora.a, workspace
    _shrink_token_kernel[(num_tokens, splits)](
        x, a, t, meta.lora_slots, lora.ranks, num_tokens, k, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), t.stride(0), lora.ranks.stride(0),
        MAX_RANK=lora.max_rank, NUM_SLICES=lora.num_slices, WIDTH_PAD=width_pad,
        BLOCK_K=config.shrink_block_k, num_warps=warps(width_pad * config.shrink_block_k),
    )  # fmt: skip
    return splits


def expand_tokens(
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32, the shrink's partials
    splits: int,
    out: torch.Tensor,  # [num_tokens, >= offsets[-1]]
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    config: LoRAKernelConfig,
) -> None:
    """Launch the per-token expand over `splits` partials of the shrink."""
    num_tokens = out.shape[0]
    b_t, t = lora.b_t, workspace
    (g, bias), flags = dora_args(lora)
    chunk, chunks = expand_chunks(lora.slice_sizes, config.expand_block_n, num_tokens, config)
    _expand_token_kernel[(num_tokens, chunks)](
        t, b_t, out, meta.lora_slots, lora.ranks, lora.scaling,
        offsets_tensor(lora.slice_offsets, out.device), g, bias, num_tokens, splits, chunk,
        t.stride(0), b_t.stride(0), b_t.stride(1), out.stride(0), lora.ranks.stride(0),
        g.stride(0),
        MAX_RANK=lora.max_rank, RANK_PAD=pad(lora.max_rank), NUM_SLICES=lora.num_slices,
        SPLITS_PAD=pad(config.max_splits), BLOCK_N=config.expand_block_n,
        num_warps=warps(pad(lora.max_rank) * config.expand_block_n), **flags,
    )  # fmt: skip
