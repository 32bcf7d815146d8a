"""What a paged-attention launch needs: input checks, kernel configurations, the split heuristic."""

from __future__ import annotations

import torch
import triton

# NOTE: a handful of candidates keeps first-call autotuning (compile + time) to seconds; BLOCK_M
# counts (token, query head) rows, so with 4 query heads per KV head BLOCK_M=128 is 32 tokens.
# (128, 64) with 4 warps spills registers at head_dim 128 on sm_90 (ptxas), so it is left out.
PREFILL_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
]

# Decode rows are the query heads of one KV head (padded to 16 for tensor cores): BLOCK_M is
# fixed by the wrapper and only the KV tile and pipelining are tuned.
DECODE_CONFIGS = [
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 256}, num_warps=8, num_stages=2),
]

# The one configuration the CPU interpreter runs (tiles small enough to cross block boundaries).
PREFILL_FALLBACK = {"BLOCK_M": 16, "BLOCK_N": 16}

MAX_SPLITS = 16
MIN_SPLIT_LEN = 256  # context tokens per split below which splitting costs more than it gains
MAX_SPLIT_TOKENS = 256  # split-KV workspace is fp32 [num_tokens, num_heads, splits, head_dim]


def choose_num_splits(programs: int, max_seq_len: int, num_tokens: int, sm_count: int) -> int:
    """How many KV splits fill the GPU: 1 unless few programs face long contexts (power of 2)."""
    if programs >= sm_count or num_tokens > MAX_SPLIT_TOKENS:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(2 * sm_count, programs), max_seq_len // MIN_SPLIT_LEN)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """Raises ValueError unless the arguments follow `paged_attention_ref`'s contract."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q must be [num_tokens, num_heads, head_dim] and k_cache [num_blocks, block_size, "
            f"num_kv_heads, head_dim]; got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    head_dim, num_heads, num_kv_heads = q.shape[2], q.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, the cache {k_cache.shape[3]}")
    if head_dim not in (32, 64, 128, 256):
        raise ValueError(f"head_dim must be 32, 64, 128 or 256, got {head_dim}")
    if num_heads % num_kv_heads != 0 or num_heads // num_kv_heads > 64:
        raise ValueError(
            f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}, "
            f"at most 64 query heads per KV head"
        )
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype:
        raise ValueError(
            f"q and the cache must share one dtype of float16/bfloat16; "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if v_cache.dtype != q.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != q dtype {q.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    num_seqs = seq_lens.shape[0]
    for name, t, shape in (
        ("query_start_loc", query_start_loc, (num_seqs + 1,)),
        ("seq_lens", seq_lens, (num_seqs,)),
        ("block_tables", block_tables, (num_seqs, block_tables.shape[-1])),
    ):
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != q.device:
            raise ValueError(
                f"{name} must be int32 of shape {shape} on {q.device}; "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    if query_start_loc.stride(0) != 1 or seq_lens.stride(0) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query_start_loc, seq_lens and block_tables rows must be contiguous")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError("q, k_cache and v_cache must be on one device")
