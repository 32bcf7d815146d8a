"""Triton multi-LoRA kernels (see `loraplex.kernels.lora` for the math and the weight layout).

One `Linear` costs two launches whatever its number of slices (one for the smallest batches,
below): a shrink that computes every slice's `x @ A^T` in one pass over `x`, and an expand that
writes every slice's columns.

- shrink grid `(token programs, num_splits)`: the reduction over `in` is split into
  `num_splits` chunks; each program writes its fp32 partial `t` rows to its own workspace block
  (`[num_splits, num_tokens, num_slices * max_rank]`), so there is no memset and no atomics.
  The expand sums the partials as it reads them.
- expand grid `(token programs, column tiles)`: tile `j` maps to `(slice, column)` through the
  slice offsets; tiles never straddle two slices. With a DoRA scale it also rescales the
  tile's base output by the slot's column scale (one more fp32 read per column).

Two variants of each, picked by token count: the *token* kernels give each program one token
(any slot, a GEMV on CUDA cores; decode batches where most tokens carry different adapters),
the *group* kernels give each program `BLOCK_M` tokens of one slot (read through `token_order`)
and use `tl.dot`. Grids depend on tensor shapes only, so both replay from CUDA graphs.

For the smallest batches (`fused_max_tokens`, inputs up to `fused_max_k`) one *fused* launch
replaces the pair: program
(token, column tile) computes its slice's `t = x @ A_s^T` over the whole reduction in registers
and expands it into its tile. The shrink is recomputed per tile (its A rows are read again,
mostly from L2), which the tile width bounds (`fused_chunks`); in exchange there is no second
launch and no workspace round trip, which is what a decode step of a few tokens pays for.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.kernels.lora import LoRAKernelConfig, LoRAKernelMeta, LoRAStack


@triton.jit
def _group_block(count_ptr, start_ptr, pid, num_slots, BLOCK_M: tl.constexpr, SLOTS: tl.constexpr):
    """The slot, first token position and token count of the `pid`-th `BLOCK_M` block of tokens
    (blocks enumerate each slot's tokens in turn); slot >= num_slots when there is no such block."""
    offs_s = tl.arange(0, SLOTS)
    counts = tl.load(count_ptr + offs_s, mask=offs_s < num_slots, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)
    slot = tl.sum((ends <= pid).to(tl.int32), 0)
    first_block = tl.sum(tl.where(offs_s == slot, ends - blocks, 0), 0)
    count = tl.sum(tl.where(offs_s == slot, counts, 0), 0)
    start = tl.load(start_ptr + slot, mask=slot < num_slots, other=0)
    return slot, start + (pid - first_block) * BLOCK_M, start + count


@triton.jit
def _tile_slice(offsets_ptr, pid_n, BLOCK_N: tl.constexpr, NUM_SLICES: tl.constexpr):
    """Slice index, first column and end column of column tile `pid_n`."""
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
def _tile_rank(offsets_ptr, rank_ptr, pid_n, slot, stride_rs, WIDTH: tl.constexpr,
               NUM_SLICES: tl.constexpr):  # fmt: skip
    """Slice, first and end column of the `WIDTH`-column tile `pid_n`, and the slot's rank on
    that slice (0: nothing to add)."""
    slice_idx, col0, col_end = _tile_slice(offsets_ptr, pid_n, WIDTH, NUM_SLICES)
    return slice_idx, col0, col_end, tl.load(rank_ptr + slice_idx * stride_rs + slot)


@triton.jit
def _shrink_token_kernel(
    x_ptr, a_ptr, t_ptr, slots_ptr, rank_ptr,
    num_tokens, K, k_per_split,
    stride_xm, stride_as, stride_ar, stride_tm, stride_rs,
    MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr + tok)
    if slot < 0:
        return
    offs_n = tl.arange(0, BLOCK_N)  # t column: slice * MAX_RANK + r
    n_mask = offs_n < NUM_SLICES * MAX_RANK
    ranks = tl.load(rank_ptr + (offs_n // MAX_RANK) * stride_rs + slot, mask=n_mask, other=0)
    n_mask = n_mask & (offs_n % MAX_RANK < ranks)
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + offs_n[:, None] * stride_ar
    x_row = x_ptr + tok.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    t_row = t_ptr + (split * num_tokens + tok).to(tl.int64) * stride_tm
    tl.store(t_row + offs_n, tl.sum(acc, 1), mask=offs_n < NUM_SLICES * MAX_RANK)


@triton.jit
def _shrink_group_kernel(
    x_ptr, a_ptr, t_ptr, order_ptr, start_ptr, count_ptr, rank_ptr,
    num_tokens, num_slots, K, k_per_split,
    stride_xm, stride_as, stride_ar, stride_tm, stride_rs,
    MAX_RANK: tl.constexpr, NUM_SLICES: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(1)
    slot, pos0, pos_end = _group_block(count_ptr, start_ptr, tl.program_id(0), num_slots,
                                       BLOCK_M, SLOTS)  # fmt: skip
    if slot >= num_slots:
        return
    offs_m = pos0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < pos_end
    rows = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < NUM_SLICES * MAX_RANK
    ranks = tl.load(rank_ptr + (offs_n // MAX_RANK) * stride_rs + slot, mask=n_mask, other=0)
    n_mask = n_mask & (offs_n % MAX_RANK < ranks)
    a_cols = a_ptr + slot.to(tl.int64) * stride_as + offs_n[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
    t_rows = t_ptr + (split * num_tokens + rows) * stride_tm
    mask = m_mask[:, None] & (offs_n < NUM_SLICES * MAX_RANK)[None, :]
    tl.store(t_rows[:, None] + offs_n[None, :], acc, mask=mask)


@triton.jit
def _dora_update(cur, delta, g_ptrs, bias_ptrs, mask, DORA: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The new output of a tile: `cur + delta`, or DoRA's `g * (cur - bias + delta) + bias`
    where the slot's column scale `g` is not 1 (fp32)."""
    new = cur + delta
    if DORA:
        g = tl.load(g_ptrs, mask=mask, other=1.0)
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
        new = tl.where(g == 1.0, new, g * (cur - bias + delta) + bias)
    return new


@triton.jit
def _expand_token_kernel(
    t_ptr, b_ptr, out_ptr, slots_ptr, rank_ptr, scaling_ptr, offsets_ptr, g_ptr, bias_ptr,
    num_tokens, num_splits,
    stride_tm, stride_bs, stride_br, stride_om, stride_rs, stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
    BLOCK_N: tl.constexpr, DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    slot = tl.load(slots_ptr + tok)
    if slot < 0:
        return
    slice_idx, col0, col_end, rank = _tile_rank(
        offsets_ptr, rank_ptr, tl.program_id(1), slot, stride_rs, BLOCK_N, NUM_SLICES
    )
    if rank == 0:
        return
    offs_r = tl.arange(0, RANK_PAD)
    r_mask = offs_r < rank
    t_cols = t_ptr + tok.to(tl.int64) * stride_tm + slice_idx * MAX_RANK + offs_r
    t = tl.zeros((RANK_PAD,), dtype=tl.float32)
    for split in range(num_splits):
        t += tl.load(t_cols + split * num_tokens * stride_tm, mask=r_mask, other=0.0)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_end
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
        mask=r_mask[:, None] & n_mask[None, :], other=0.0,
    )  # fmt: skip
    delta = tl.sum(t[:, None] * b.to(tl.float32), 0) * tl.load(
        scaling_ptr + slice_idx * stride_rs + slot
    )
    o_ptrs = out_ptr + tok.to(tl.int64) * stride_om + offs_n
    cur = tl.load(o_ptrs, mask=n_mask, other=0.0)
    g_ptrs = g_ptr + slot.to(tl.int64) * stride_gs + offs_n
    new = _dora_update(cur.to(tl.float32), delta, g_ptrs, bias_ptr + offs_n, n_mask, DORA, HAS_BIAS)
    tl.store(o_ptrs, new.to(cur.dtype), mask=n_mask)


@triton.jit
def _fused_token_kernel(
    x_ptr, a_ptr, b_ptr, out_ptr, slots_ptr, rank_ptr, scaling_ptr, offsets_ptr, g_ptr, bias_ptr,
    K,
    stride_xm, stride_as, stride_ar, stride_bs, stride_br, stride_om, stride_rs, stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Program (token, tile): the token's shrink for the tile's slice, then CHUNKS consecutive
    BLOCK_N-column chunks of its expand."""
    tok = tl.program_id(0)
    slot = tl.load(slots_ptr + tok)
    if slot < 0:
        return
    slice_idx, col0, col_end, rank = _tile_rank(
        offsets_ptr, rank_ptr, tl.program_id(1), slot, stride_rs, CHUNKS * BLOCK_N, NUM_SLICES
    )
    if rank == 0:
        return
    offs_r = tl.arange(0, RANK_PAD)
    r_mask = offs_r < rank
    a_rows = (
        a_ptr + slot.to(tl.int64) * stride_as + (slice_idx * MAX_RANK + offs_r)[:, None] * stride_ar
    )
    x_row = x_ptr + tok.to(tl.int64) * stride_xm
    # NOTE: Triton does not pipeline loads that feed no `tl.dot`, so each iteration waits for its
    # loads: wide BLOCK_K chunks (up to 64 KB of A) keep enough bytes in flight per iteration,
    # and the chunk is reduced at once so no [RANK_PAD, BLOCK_K] accumulator holds registers.
    t = tl.zeros((RANK_PAD,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_mask, other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        t += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], 1)  # zero beyond the rank
    scaling = tl.load(scaling_ptr + slice_idx * stride_rs + slot)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
    o_row = out_ptr + tok.to(tl.int64) * stride_om
    g_row = g_ptr + slot.to(tl.int64) * stride_gs
    for chunk in range(CHUNKS):
        offs_n = col0 + chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_rows + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.sum(t[:, None] * b.to(tl.float32), 0) * scaling
        cur = tl.load(o_row + offs_n, mask=n_mask, other=0.0)
        new = _dora_update(cur.to(tl.float32), delta, g_row + offs_n, bias_ptr + offs_n, n_mask,
                           DORA, HAS_BIAS)  # fmt: skip
        tl.store(o_row + offs_n, new.to(cur.dtype), mask=n_mask)


@triton.jit
def _expand_group_kernel(
    t_ptr, b_ptr, out_ptr, order_ptr, start_ptr, count_ptr, rank_ptr, scaling_ptr, offsets_ptr,
    g_ptr, bias_ptr,
    num_tokens, num_slots, num_splits,
    stride_tm, stride_bs, stride_br, stride_om, stride_rs, stride_gs,
    MAX_RANK: tl.constexpr, RANK_PAD: tl.constexpr, NUM_SLICES: tl.constexpr,
    SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr,
    PRECISION: tl.constexpr, DORA: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Program (block, tile) writes CHUNKS consecutive BLOCK_N-column chunks of one slice for a
    block of tokens, so it reads (and sums the split partials of) `t` once for all of them."""
    slot, pos0, pos_end = _group_block(count_ptr, start_ptr, tl.program_id(0), num_slots,
                                       BLOCK_M, SLOTS)  # fmt: skip
    if slot >= num_slots:
        return
    slice_idx, col0, col_end, rank = _tile_rank(
        offsets_ptr, rank_ptr, tl.program_id(1), slot, stride_rs, CHUNKS * BLOCK_N, NUM_SLICES
    )
    if rank == 0:
        return
    offs_m = pos0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < pos_end
    rows = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, RANK_PAD)
    r_mask = offs_r < rank
    t_ptrs = t_ptr + rows[:, None] * stride_tm + (slice_idx * MAX_RANK + offs_r)[None, :]
    t_mask = m_mask[:, None] & r_mask[None, :]
    t = tl.zeros((BLOCK_M, RANK_PAD), dtype=tl.float32)
    for split in range(num_splits):
        t += tl.load(t_ptrs + split * num_tokens * stride_tm, mask=t_mask, other=0.0)
    scaling = tl.load(scaling_ptr + slice_idx * stride_rs + slot)
    b_rows = b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
    o_rows = out_ptr + rows[:, None] * stride_om
    for chunk in range(CHUNKS):
        offs_n = col0 + chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < col_end
        b = tl.load(b_rows + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(t.to(b.dtype), b, input_precision=PRECISION) * scaling
        mask = m_mask[:, None] & n_mask[None, :]
        cur = tl.load(o_rows + offs_n[None, :], mask=mask, other=0.0)
        g_ptrs = g_ptr + slot.to(tl.int64) * stride_gs + offs_n[None, :]
        new = _dora_update(cur.to(tl.float32), acc, g_ptrs, bias_ptr + offs_n[None, :],
                           n_mask[None, :], DORA, HAS_BIAS)  # fmt: skip
        tl.store(o_rows + offs_n[None, :], new.to(cur.dtype), mask=mask)


@triton.jit
def _kernel_meta_kernel(
    slots_ptr, order_ptr, start_ptr, count_ptr, num_tokens, num_slots,
    SLOTS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: a stable counting sort of the tokens by slot (base tokens last)."""
    bins = tl.arange(0, SLOTS)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros((SLOTS,), dtype=tl.int32)
    for c0 in range(0, num_tokens, CHUNK):
        valid = c0 + lane < num_tokens
        s = tl.load(slots_ptr + c0 + lane, mask=valid, other=0)
        key = tl.where(valid, tl.where(s < 0, num_slots, s), SLOTS)
        counts += tl.sum((key[:, None] == bins[None, :]).to(tl.int32), 0)
    cursor = tl.cumsum(counts, 0) - counts
    tl.store(start_ptr + bins, cursor, mask=bins < num_slots)
    tl.store(count_ptr + bins, counts, mask=bins < num_slots)
    for c0 in range(0, num_tokens, CHUNK):
        valid = c0 + lane < num_tokens
        s = tl.load(slots_ptr + c0 + lane, mask=valid, other=0)
        key = tl.where(valid, tl.where(s < 0, num_slots, s), SLOTS)
        onehot = key[:, None] == bins[None, :]  # [CHUNK, SLOTS]
        same_before = (key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])
        pos = tl.sum(tl.where(onehot, cursor[None, :], 0), 1)
        pos += tl.sum(same_before.to(tl.int32), 1)
        tl.store(order_ptr + pos, c0 + lane, mask=valid)
        cursor += tl.sum(onehot.to(tl.int32), 0)


def _warps(tile_elements: int) -> int:
    # NOTE: 4 warps hold a 4096-element fp32 tile plus its operands in about 150 registers;
    # larger tiles get 8 warps so nothing spills (checked with an offline sm_90 compile).
    return 8 if tile_elements >= 4096 else 4


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=64)
def _offsets_tensor(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # NOTE: cached, so the tensor a CUDA graph captured stays alive and unchanged.
    return torch.tensor(offsets, dtype=torch.int32, device=device)  # [num_slices + 1]


def num_splits(num_tokens: int, k: int, workspace_rows: int, config: LoRAKernelConfig) -> int:
    """How many chunks the shrink splits `in` into: enough programs to fill the GPU, within the
    workspace (`num_splits * num_tokens` rows) and without empty chunks."""
    if config.use_token_kernels(num_tokens):
        programs = num_tokens
    else:
        programs = triton.cdiv(num_tokens, config.group_block_m)
    splits = min(
        triton.cdiv(config.target_programs, programs),
        config.max_splits,
        workspace_rows // num_tokens,
    )
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, splits)), config.shrink_block_k)
    return triton.cdiv(k, k_per_split * config.shrink_block_k)


def expand_chunks(blocks: int, slice_sizes: tuple[int, ...], config: LoRAKernelConfig) -> int:
    """Column chunks per grouped-expand program: the most (up to `group_expand_max_chunks`)
    that still leave about `group_expand_programs` programs, so wide projections (gate-up)
    read each block's `t` once per several chunks while narrow ones keep the GPU busy."""
    chunks = 1
    while chunks < config.group_expand_max_chunks:
        width = 2 * chunks * config.group_block_n
        if blocks * sum(triton.cdiv(n, width) for n in slice_sizes) < config.group_expand_programs:
            break
        chunks *= 2
    return chunks


def fused_tiles(
    num_tokens: int, slice_sizes: tuple[int, ...], max_rank: int, config: LoRAKernelConfig
) -> tuple[int, int]:
    """(BLOCK_N, CHUNKS) of the fused kernel: `expand_block_n` columns per chunk, fewer for
    large ranks (so a `[rank, BLOCK_N]` tile of B fits in registers); then the fewest chunks per
    program (each program repeats its slice's shrink) that keep the grid within about
    `fused_programs` programs."""
    rank_pad = max(16, triton.next_power_of_2(max_rank))
    block_n = min(config.expand_block_n, max(16, 4096 // rank_pad))
    chunks = 1
    while num_tokens * sum(
        triton.cdiv(n, chunks * block_n) for n in slice_sizes
    ) > config.fused_programs and chunks * block_n < max(slice_sizes):
        chunks *= 2
    return block_n, chunks


def lora_triton(
    x: torch.Tensor,  # [num_tokens, in]
    out: torch.Tensor,  # [num_tokens, >= offsets[-1]]
    lora: LoRAStack,
    meta: LoRAKernelMeta,
    workspace: torch.Tensor,  # [rows, >= num_slices * max_rank] fp32
    config: LoRAKernelConfig,
) -> None:
    """Add every token's LoRA delta of every slice into `out`: one fused launch for the
    smallest batches, else one shrink and one expand."""
    num_tokens, k = x.shape
    num_slots = lora.a.shape[0]
    num_slices, max_rank = lora.num_slices, lora.max_rank
    if num_tokens == 0:
        return
    splits = num_splits(num_tokens, k, workspace.shape[0], config)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), config.shrink_block_k)
    k_per_split *= config.shrink_block_k
    offsets = _offsets_tensor(lora.slice_offsets, x.device)
    rank_pad = max(16, triton.next_power_of_2(max_rank))
    shrink_n = max(16, triton.next_power_of_2(num_slices * max_rank))
    t, a, b_t = workspace, lora.a, lora.b_t
    stride_rs = lora.ranks.stride(0)
    dora = lora.dora_scale is not None
    g = lora.dora_scale if lora.dora_scale is not None else lora.scaling  # a dummy without DoRA
    bias = lora.base_bias if lora.base_bias is not None else g
    dora_args = (g, bias)
    dora_flags = {"DORA": dora, "HAS_BIAS": lora.base_bias is not None}
    if config.use_fused_kernel(num_tokens, k):
        block_n, chunks = fused_tiles(num_tokens, lora.slice_sizes, max_rank, config)
        tiles = sum(triton.cdiv(n, chunks * block_n) for n in lora.slice_sizes)
        block_k = max(config.shrink_block_k, config.fused_block_elems // rank_pad)
        _fused_token_kernel[(num_tokens, tiles)](
            x, a, b_t, out, meta.lora_slots, lora.ranks, lora.scaling, offsets, *dora_args, k,
            x.stride(0), a.stride(0), a.stride(1), b_t.stride(0), b_t.stride(1), out.stride(0),
            stride_rs, g.stride(0),
            MAX_RANK=max_rank, RANK_PAD=rank_pad, NUM_SLICES=num_slices,
            BLOCK_N=block_n, BLOCK_K=block_k, CHUNKS=chunks,
            num_warps=_warps(rank_pad * max(block_n, block_k)), **dora_flags,
        )  # fmt: skip
        return
    if config.use_token_kernels(num_tokens):
        _shrink_token_kernel[(num_tokens, splits)](
            x, a, t, meta.lora_slots, lora.ranks, num_tokens, k, k_per_split,
            x.stride(0), a.stride(0), a.stride(1), t.stride(0), stride_rs,
            MAX_RANK=max_rank, NUM_SLICES=num_slices, BLOCK_N=shrink_n,
            BLOCK_K=config.shrink_block_k, num_warps=_warps(shrink_n * config.shrink_block_k),
        )  # fmt: skip
        tiles = sum(triton.cdiv(n, config.expand_block_n) for n in lora.slice_sizes)
        _expand_token_kernel[(num_tokens, tiles)](
            t, b_t, out, meta.lora_slots, lora.ranks, lora.scaling, offsets, *dora_args,
            num_tokens, splits,
            t.stride(0), b_t.stride(0), b_t.stride(1), out.stride(0), stride_rs, g.stride(0),
            MAX_RANK=max_rank, RANK_PAD=rank_pad, NUM_SLICES=num_slices,
            BLOCK_N=config.expand_block_n, **dora_flags,
        )  # fmt: skip
        return
    bm, slots_pad = config.group_block_m, max(16, triton.next_power_of_2(num_slots))
    blocks = triton.cdiv(num_tokens, bm) + min(num_slots, num_tokens)
    group = (meta.token_order, meta.slot_start, meta.slot_count)
    _shrink_group_kernel[(blocks, splits)](
        x, a, t, *group, lora.ranks, num_tokens, num_slots, k, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), t.stride(0), stride_rs,
        MAX_RANK=max_rank, NUM_SLICES=num_slices, SLOTS=slots_pad, BLOCK_M=bm,
        BLOCK_N=shrink_n, BLOCK_K=config.shrink_block_k, PRECISION=_precision(x.dtype),
        num_warps=_warps(shrink_n * config.shrink_block_k),
    )  # fmt: skip
    chunks = expand_chunks(blocks, lora.slice_sizes, config)
    width = chunks * config.group_block_n
    tiles = sum(triton.cdiv(n, width) for n in lora.slice_sizes)
    _expand_group_kernel[(blocks, tiles)](
        t, b_t, out, *group, lora.ranks, lora.scaling, offsets, *dora_args,
        num_tokens, num_slots, splits,
        t.stride(0), b_t.stride(0), b_t.stride(1), out.stride(0), stride_rs, g.stride(0),
        MAX_RANK=max_rank, RANK_PAD=rank_pad, NUM_SLICES=num_slices, SLOTS=slots_pad,
        BLOCK_M=bm, BLOCK_N=config.group_block_n, CHUNKS=chunks, PRECISION=_precision(b_t.dtype),
        num_warps=_warps(bm * config.group_block_n), **dora_flags,
    )  # fmt: skip


def kernel_meta_triton(meta: LoRAKernelMeta, num_slots: int) -> None:
    """Fill `meta`'s token_order, slot_start and slot_count from its lora_slots, in place, in
    one launch (no host synchronisation; graph-safe)."""
    num_tokens = meta.lora_slots.shape[0]
    _kernel_meta_kernel[(1,)](
        meta.lora_slots, meta.token_order, meta.slot_start, meta.slot_count,
        num_tokens, num_slots, SLOTS=triton.next_power_of_2(num_slots + 1), CHUNK=64,
    )  # fmt: skip
