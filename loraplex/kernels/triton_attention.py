"""Triton paged attention over the block-table KV cache (prefill, chunked prefill, decode).

One kernel serves every batch shape. A program owns one tile of query tokens of one sequence and
one KV head; its rows are (token, query head of the GQA group) pairs, so each K/V tile is loaded
once for the whole group. It walks the sequence's cached pages with an online softmax, first the
pages every query in the tile sees in full (no mask), then the causal tail. For small batches with
long contexts the KV range is split across programs and a second kernel merges the partial
softmax states (split-KV). Grids derive from tensor shapes and host ints only, never from data,
so decode is CUDA-graph capturable.

Query tiles are found on device: sequence i's tiles take grid slots starting at
`query_start_loc[i] // BLOCK_Q + i`, which never overlap and fit in
`cdiv(num_tokens, BLOCK_Q) + num_seqs` slots; a program binary-searches its sequence and exits
early when its slot lies past that sequence's last tile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton_attention_setup import (
    DECODE_CONFIGS,
    PREFILL_CONFIGS,
    PREFILL_FALLBACK,
    check_inputs,
    choose_num_splits,
)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Largest sequence i whose first tile slot (query_start_loc[i] // BLOCK_Q + i) is <= tile."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, q_pos, start, kv_end, k_base, v_base, table_ptr,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over cache positions [start, start + BLOCK_N)."""
    n = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if MASKED:
        n_ok = n < kv_end
        block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        block = tl.load(table_ptr + n // BLOCK_SIZE).to(tl.int64)
    offset = n % BLOCK_SIZE
    k_ptrs = k_base + block[:, None] * stride_kb + offset[:, None] * stride_ks + dims[None, :]
    v_ptrs = v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs + dims[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # NOTE: a row can see nothing in this block (a query before a split's range); subtract 0
    # instead of -inf there so no inf - inf = NaN appears, and its weights stay exactly 0.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_sub)
    p = tl.math.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        # NOTE: zero, not garbage, past the context: 0 * NaN from stale cache memory is NaN.
        v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, num_seqs, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, num_heads,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_DECODE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if IS_DECODE:
        seq = tile
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if IS_DECODE:
        q_tile = 0
    else:
        num_q_tiles = tl.cdiv(q_len, BLOCK_Q)
        local = tile - (q_start // BLOCK_Q + seq)
        if local >= num_q_tiles:
            return
        q_tile = num_q_tiles - 1 - local  # latest (heaviest) tiles launch first

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // G_PAD  # token index inside the sequence's new tokens
    head = kv_head * GROUP + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < GROUP)
    prefix = seq_len - q_len
    q_pos = prefix + tok  # [BLOCK_M] position of each row's token in the context
    dims = tl.arange(0, HEAD_DIM)
    token = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    kv_end = prefix + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)  # exclusive
    lo = 0
    hi = kv_end
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(split * chunk, kv_end)
        hi = tl.minimum(lo + chunk, kv_end)
    # Whole BLOCK_N tiles at or before the tile's first query position need no mask.
    open_end = tl.maximum(tl.minimum(hi, prefix + q_tile * BLOCK_Q + 1), lo)
    unmasked_end = lo + (open_end - lo) // BLOCK_N * BLOCK_N

    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, q_pos, start, kv_end, k_base, v_base, table_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            False, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
        )  # fmt: skip
    for start in range(unmasked_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, q_pos, start, kv_end, k_base, v_base, table_ptr,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            True, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # Partial states [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM] and [..., 2] (max, sum).
        part = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Combines the per-split (acc, max, sum) softmax states of one (token, head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * NUM_HEADS + head
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(part_ml_ptr + row * NUM_SPLITS * 2 + splits * 2)  # [NUM_SPLITS]
    l_s = tl.load(part_ml_ptr + row * NUM_SPLITS * 2 + splits * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits -> 0
    acc = tl.load(part_acc_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :])
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty)
    )


_prefill_tuned = triton.autotune(
    configs=PREFILL_CONFIGS, key=["HEAD_DIM", "GROUP", "NUM_SPLITS", "BLOCK_SIZE"]
)(_paged_attention_kernel)
_decode_tuned = triton.autotune(
    configs=DECODE_CONFIGS, key=["HEAD_DIM", "GROUP", "NUM_SPLITS", "BLOCK_SIZE"]
)(_paged_attention_kernel)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged attention with the Triton kernels; same contract as `paged_attention_ref`.

    Host-side hints (ints the runner already knows; none is read back from the device):
    `max_query_len == 1` selects the decode grid (one program per sequence and KV head);
    `max_seq_len` sizes the split-KV decision (default: the block table's capacity, which is
    fixed for a captured CUDA graph). `num_splits` forces the split count (tests). Padding
    sequences with `seq_lens == 0` get zero output. The first call per shape family autotunes,
    so run it once before capturing a CUDA graph.
    """
    check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    is_decode = max_query_len == 1
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    interpret = not q.is_cuda
    sm_count = 132 if interpret else _sm_count(q.device.index or 0)
    decode_block_m = max(16, g_pad)
    if is_decode:
        tiles_hint = num_seqs
    else:
        tiles_hint = triton.cdiv(num_tokens, max(1, 128 // g_pad)) + num_seqs
    if num_splits is None:
        num_splits = choose_num_splits(tiles_hint * num_kv_heads, max_seq_len, num_tokens, sm_count)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")

    if num_splits > 1:
        part_acc = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_ml = torch.empty(
            num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device
        )
    else:
        part_acc = part_ml = out  # unused by the kernel when NUM_SPLITS == 1

    def grid(meta: dict) -> tuple[int, int, int]:
        if is_decode:
            return (num_seqs, num_kv_heads, num_splits)
        block_q = meta["BLOCK_M"] // g_pad
        return (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads, num_splits)

    args = (
        out, part_acc, part_ml, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        num_seqs, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        num_heads,
    )  # fmt: skip
    meta = dict(
        GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits, IS_DECODE=is_decode,
    )  # fmt: skip
    if interpret:
        block_m = decode_block_m if is_decode else max(PREFILL_FALLBACK["BLOCK_M"], g_pad)
        fixed = dict(BLOCK_M=block_m, BLOCK_N=PREFILL_FALLBACK["BLOCK_N"])
        _paged_attention_kernel[grid({**meta, **fixed})](*args, **meta, **fixed)
    elif is_decode:
        _decode_tuned[grid](*args, **meta, BLOCK_M=decode_block_m)
    else:
        _prefill_tuned[grid](*args, **meta)

    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out
