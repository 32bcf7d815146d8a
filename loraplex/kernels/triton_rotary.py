"""Triton rotary embedding (neox / rotate-half layout) for q and k in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, num_heads, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    src = x_ptr + token * stride_xt + heads * stride_xh + dims
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads * stride_oh + dims
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, cache_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, num_heads, num_kv_heads,
    stride_c, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_c + dims, mask=dims < HALF)  # [1, BLOCK_HALF] fp32
    sin = tl.load(cache_ptr + pos * stride_c + HALF + dims, mask=dims < HALF)
    if tl.program_id(1) == 0:
        _rotate_heads(
            q_ptr, q_out_ptr, token, num_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
            cos, sin, HALF, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, k_out_ptr, token, num_kv_heads, stride_kt, stride_kh, stride_kot, stride_koh,
            cos, sin, HALF, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip


def apply_rotary_triton(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], any token/head strides
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [max_positions, head_dim] fp32: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (new contiguous tensors; the inputs are not modified)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] "
            f"disagree: {tuple(q.shape)} vs {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2 != 0 or cache.dim() != 2 or cache.shape[1] != head_dim:
        raise ValueError(f"cache {tuple(cache.shape)} must be [max_positions, {head_dim}] (even)")
    if cache.dtype != torch.float32 or cache.stride(1) != 1:
        raise ValueError(f"cache must be contiguous float32, got {cache.dtype}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be int32/int64 of shape ({q.shape[0]},); "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )
    if q.stride(2) != 1 or k.stride(2) != 1 or positions.stride(0) != 1:
        raise ValueError("q, k and positions need a contiguous last dimension")
    if len({t.device for t in (positions, q, k, cache)}) != 1:
        raise ValueError("positions, q, k and cache must be on one device")
    q_out, k_out = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    if q.shape[0] == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(q.shape[0], 2)](
        positions, cache, q, k, q_out, k_out, q.shape[1], k.shape[1], cache.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        HALF=half, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
        BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip
    return q_out, k_out
