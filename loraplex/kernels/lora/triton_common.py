"""Pieces every LoRA Triton kernel shares: where a column tile lies, the DoRA update, the
slot block of a grouped program, the sum of a split shrink's partials, one token's delta on a
fused kernel's output rows, and host-side sizing."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def tile_slice(offsets_ptr, pid_n, BLOCK_N, NUM_SLICES: tl.constexpr):
    """Slice index, first column and end column of column tile `pid_n`, `BLOCK_N` columns wide
    (a constexpr or a run-time width; tiles never straddle two slices)."""
    tiles_before = 0
    slice_idx = 0
    col0 = 0
    col_end = 0
    for s in tl.static_range(NUM_SLICES):
        lo = tl.load(offsets_ptr + s)
        hi = tl.load(offsets_ptr + s + 1)
        tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
        inside = (pid_n >= tiles_before) & (pid_n < tiles_before + tiles)
        slice_idx = tl.where(inside, s, slice_idx)
        col0 = tl.where(inside, lo + (pid_n - tiles_before) * BLOCK_N, col0)
        col_end = tl.where(inside, hi, col_end)
        tiles_before += tiles
    return slice_idx, col0, col_end


@triton.jit
def dora_update(cur, delta, g_ptrs, bias_ptrs, mask, DORA: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The new output of a tile: `cur + delta`, or DoRA's `g * (cur - bias + delta) + bias`
    where the slot's column scale `g` is not 1 (fp32)."""
    new = cur + delta
    if DORA:
        g = tl.load(g_ptrs, mask=mask, other=1.0)
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
        new = dora_combine(cur, delta, g, bias)
    return new


@triton.jit
def dora_combine(cur, delta, g, bias):
    """`dora_update` on loaded values: `cur + delta` where the column scale `g` is 1, else
    `g * (cur - bias + delta) + bias` (fp32; `bias` 0.0 for a layer without one)."""
    return tl.where(g == 1.0, cur + delta, g * (cur - bias + delta) + bias)


@triton.jit
def group_scan(count_ptr, num_slots, BLOCK_M: tl.constexpr, SLOTS: tl.constexpr):
    """Each slot's token count, its `BLOCK_M` blocks and their running end (blocks enumerate each
    slot's tokens in turn); the step's block count is `tl.sum(blocks, 0)`."""
    offs_s = tl.arange(0, SLOTS)
    counts = tl.load(count_ptr + offs_s, mask=offs_s < num_slots, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    return counts, blocks, tl.cumsum(blocks, 0)


@triton.jit
def group_block(counts, blocks, ends, start_ptr, block, num_slots, BLOCK_M: tl.constexpr,
                SLOTS: tl.constexpr):  # fmt: skip
    """The slot, first token position and end position of block `block` of `group_scan`'s
    blocks; slot >= num_slots when there is no such block."""
    offs_s = tl.arange(0, SLOTS)
    slot = tl.sum((ends <= block).to(tl.int32), 0)
    first_block = tl.sum(tl.where(offs_s == slot, ends - blocks, 0), 0)
    count = tl.sum(tl.where(offs_s == slot, counts, 0), 0)
    start = tl.load(start_ptr + slot, mask=slot < num_slots, other=0)
    return slot, start + (block - first_block) * BLOCK_M, start + count


@triton.jit
def group_splits(num_blocks, programs, K, max_splits, BLOCK_K: tl.constexpr):
    """(splits, input features per split) of a grouped shrink whose `programs` share the step's
    `num_blocks` blocks: as many splits of whole `BLOCK_K` blocks as fill them, at most
    `max_splits`, none empty (the host's `split_k` on the device, so that the split count follows
    the step's blocks and not the grid's worst case)."""
    wanted = tl.maximum(tl.minimum(programs // tl.maximum(num_blocks, 1), max_splits), 1)
    per_split = tl.cdiv(tl.cdiv(K, wanted), BLOCK_K) * BLOCK_K
    return tl.cdiv(K, per_split), per_split


@triton.jit
def shrink_item(x_row, a_ptr, rank_ptr, t_row, slot, k_lo, k_hi, stride_as, stride_ar,
                stride_rs, MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr,
                WIDTH_PAD: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One token's partial `t` of every slice over input features `[k_lo, k_hi)` (fp32, 0 past
    each slice's rank), stored at `t_row`: a one-launch kernel's shrink work item."""
    offs_n = tl.arange(0, WIDTH_PAD)  # t column: slice * MAX_RANK + r
    n_mask = offs_n < NUM_SLICES * MAX_RANK
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_n[:, None] * stride_ar
    acc = tl.zeros((WIDTH_PAD,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    ranks = tl.load(rank_ptr + (offs_n // MAX_RANK) * stride_rs + slot, mask=n_mask, other=0)
    tl.store(t_row + offs_n, tl.where(offs_n % MAX_RANK < ranks, acc, 0.0), mask=n_mask)


@triton.jit
def row_lora_operands(offsets_ptr, rank_ptr, scaling_ptr, b_ptr, rows, row_ok, slot,
                      stride_rs, stride_bs, stride_br, NUM_SLICES: tl.constexpr,
                      RANK_PAD: tl.constexpr):  # fmt: skip
    """What a fused kernel's output rows need of one token's adapter (`slot`, -1: none): each
    row's slice (0 outside every slice), which rows take a delta, the rank mask
    `[BLOCK_N, RANK_PAD]`, the slice's scaling and the rows of B^T. None of it waits for the
    shrink, so a kernel loads it before its base product: the chain of dependent loads (offsets,
    then rank, then B) runs behind the weight stream instead of after it."""
    slice_idx = tl.full(rows.shape, -1, dtype=tl.int32)
    for s in tl.static_range(NUM_SLICES):
        lo = tl.load(offsets_ptr + s)
        hi = tl.load(offsets_ptr + s + 1)
        slice_idx = tl.where((rows >= lo) & (rows < hi), s, slice_idx)
    # NOTE: the slot test as a tensor, like the others (a scalar mask breaks the interpreter)
    in_lora = row_ok & (slice_idx >= 0) & (tl.zeros_like(slice_idx) + slot >= 0)
    safe_slice = tl.maximum(slice_idx, 0)
    safe_slot = tl.maximum(slot, 0).to(tl.int64)
    rank = tl.load(rank_ptr + safe_slice * stride_rs + safe_slot, mask=in_lora, other=0)
    scaling = tl.load(scaling_ptr + safe_slice * stride_rs + safe_slot, mask=in_lora, other=0.0)
    offs_r = tl.arange(0, RANK_PAD)
    r_mask = offs_r[None, :] < rank[:, None]  # [BLOCK_N, RANK_PAD]
    b = tl.load(b_ptr + safe_slot * stride_bs + offs_r[None, :] * stride_br + rows[:, None],
                mask=r_mask, other=0.0)  # fmt: skip
    return safe_slice, in_lora, r_mask, scaling, b


@triton.jit
def row_lora_delta(t_ptr, count_ptr, safe_slice, r_mask, scaling, b, MAX_RANK: tl.constexpr,
                   RANK_PAD: tl.constexpr, ARRIVALS: tl.constexpr, MAX_POLLS: tl.constexpr):  # fmt: skip
    """The rows' delta `scaling * t @ B^T` (fp32 `[BLOCK_N]`, 0 where `r_mask` is off) once
    the `ARRIVALS` programs that write one token's `t` (`t_ptr`, `[num_slices * MAX_RANK]`) have
    counted on `count_ptr`: a bounded poll, then the rows' slice of `t`."""
    done = tl.load(count_ptr, volatile=True)
    polls = 0
    while (done < ARRIVALS) & (polls < MAX_POLLS):
        done = tl.load(count_ptr, volatile=True)
        polls += 1
    # NOTE: the count read gates the load of t (it reads L2, `.cg`)
    t_mask = r_mask & ((tl.zeros_like(safe_slice) + done)[:, None] >= ARRIVALS)
    offs_r = tl.arange(0, RANK_PAD)
    t = tl.load(t_ptr + (safe_slice * MAX_RANK)[:, None] + offs_r[None, :], mask=t_mask,
                other=0.0, cache_modifier=".cg")  # fmt: skip
    return tl.sum(t * b.to(tl.float32), 1) * scaling


@triton.jit
def sum_partials(t_ptrs, mask, num_splits, split_stride, MAX_SPLITS: tl.constexpr):
    """The sum over a split shrink's partials `t_ptrs + split * split_stride` (fp32, 0 where
    masked). NOTE: unrolled with masks, so every partial's load is in flight at once."""
    t = tl.load(t_ptrs, mask=mask, other=0.0)
    zero = tl.zeros_like(mask.to(tl.int32))  # NOTE: the split test as a tensor, like the mask
    for split in tl.static_range(1, MAX_SPLITS):
        used = mask & (zero + split < num_splits)
        t += tl.load(t_ptrs + split * split_stride, mask=used, other=0.0)
    return t


@triton.jit
def sum_token_partials(t_ptr, tok, num_tokens, num_splits, stride_tm, col0, r_mask,
                       SPLITS_PAD: tl.constexpr, RANK_PAD: tl.constexpr):  # fmt: skip
    """One token's `t[col0 : col0 + RANK_PAD]` summed over the first `num_splits` partials
    (`[num_splits, num_tokens, width]` rows), read as one `[SPLITS_PAD, RANK_PAD]` tile (fp32,
    0 where `r_mask` is off)."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_r = tl.arange(0, RANK_PAD)
    rows = (offs_s * num_tokens + tok).to(tl.int64) * stride_tm
    ptrs = t_ptr + rows[:, None] + col0 + offs_r[None, :]
    mask = (offs_s < num_splits)[:, None] & r_mask[None, :]
    return tl.sum(tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg"), 0)


def warps(tile_elements: int) -> int:
    # NOTE: 4 warps hold a 4096-element fp32 tile plus its operands in about 150 registers;
    # larger tiles get 8 warps so nothing spills (checked with an offline sm_90 compile).
    return 8 if tile_elements >= 4096 else 4


def precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def pad(n: int) -> int:
    """The power of two (at least 16) a rank or width pads to inside the kernels."""
    return max(16, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=64)
def offsets_tensor(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # NOTE: cached, so the tensor a CUDA graph captured stays alive and unchanged.
    return torch.tensor(offsets, dtype=torch.int32, device=device)  # [num_slices + 1]


def split_k(k: int, splits: int, block_k: int) -> tuple[int, int]:
    """(splits, input features per split) for at most `splits` chunks of whole `block_k`
    blocks, with no empty chunk."""
    per_split = triton.cdiv(triton.cdiv(k, max(1, splits)), block_k) * block_k
    return triton.cdiv(k, per_split), per_split


def column_tiles(slice_sizes: tuple[int, ...], block_n: int) -> int:
    return sum(triton.cdiv(n, block_n) for n in slice_sizes)


def expand_chunks(
    slice_sizes: tuple[int, ...], block_n: int, row_blocks: int, config
) -> tuple[int, int]:
    """(columns per expand program, column chunks): each program of an expand loops over up to
    `config.expand_max_tiles` tiles of `block_n` columns of one slice, so that its per-program
    work (finding its tokens, summing the shrink's partials) is done once for several tiles,
    while about `config.expand_programs` programs remain over `row_blocks` blocks of rows."""
    tiles = column_tiles(slice_sizes, block_n)
    per_program = 1
    if config.expand_programs > 0:
        per_program = max(1, min(config.expand_max_tiles,
                                 row_blocks * tiles // config.expand_programs))  # fmt: skip
    chunk = block_n * per_program
    return chunk, column_tiles(slice_sizes, chunk)


def dora_args(lora) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, bool]]:
    """The DoRA scale and bias pointers (dummies without DoRA) and the kernels' flags."""
    g = lora.dora_scale if lora.dora_scale is not None else lora.scaling  # a dummy without DoRA
    bias = lora.base_bias if lora.base_bias is not None else g
    flags = {"DORA": lora.dora_scale is not None, "HAS_BIAS": lora.base_bias is not None}
    return (g, bias), flags
