"""Triton rotary embedding (neox / rotate-half layout) for q and k in one launch, and the fused
variant that also writes the rotated k and the v rows into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.triton_kv_cache import check_kv_write


@triton.jit
def _rotate_heads(
    x_row, out_row, num_heads, stride_xh, stride_oh, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # x_row / out_row point at one token's [num_heads, 2 * HALF] rows (any head stride).
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    src = x_row + heads * stride_xh + dims
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    dst = out_row + heads * stride_oh + dims
    # NOTE: round to x's dtype first, then to the output's, so that a cache of another dtype
    # holds exactly what rotating and then writing k in two steps would have stored.
    x_ty = x_row.dtype.element_ty
    out_ty = out_row.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(x_ty).to(out_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(x_ty).to(out_ty), mask=mask)


@triton.jit
def _load_cos_sin(
    positions_ptr, cache_ptr, token, stride_c, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_c + dims, mask=dims < HALF)  # [1, BLOCK_HALF] fp32
    sin = tl.load(cache_ptr + pos * stride_c + HALF + dims, mask=dims < HALF)
    return cos, sin


@triton.jit
def _rotary_kernel(
    positions_ptr, cache_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, num_heads, num_kv_heads,
    stride_c, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _load_cos_sin(positions_ptr, cache_ptr, token, stride_c, HALF, BLOCK_HALF)
    if tl.program_id(1) == 0:
        _rotate_heads(
            q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, num_heads,
            stride_qh, stride_qoh, cos, sin, HALF, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, num_kv_heads,
            stride_kh, stride_koh, cos, sin, HALF, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip


@triton.jit
def _rotary_write_kv_kernel(
    positions_ptr, cache_ptr, slot_mapping_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr,
    k_cache_ptr, v_cache_ptr, num_heads, num_kv_heads, stride_c,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    # Grid (num_tokens, 3): part 0 rotates q, part 1 rotates k into the cache, part 2 copies v.
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 0:
        cos, sin = _load_cos_sin(positions_ptr, cache_ptr, token, stride_c, HALF, BLOCK_HALF)
        _rotate_heads(
            q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, num_heads,
            stride_qh, stride_qoh, cos, sin, HALF, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:  # -1 = padding token: nothing goes into the cache
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            if part == 1:
                cos, sin = _load_cos_sin(
                    positions_ptr, cache_ptr, token, stride_c, HALF, BLOCK_HALF
                )
                _rotate_heads(
                    k_ptr + token * stride_kt,
                    k_cache_ptr + block * stride_kcb + offset * stride_kcs, num_kv_heads,
                    stride_kh, stride_kch, cos, sin, HALF, BLOCK_KV, BLOCK_HALF,
                )  # fmt: skip
            else:
                heads = tl.arange(0, BLOCK_KV)[:, None]
                dims = tl.arange(0, 2 * BLOCK_HALF)[None, :]
                mask = (heads < num_kv_heads) & (dims < 2 * HALF)
                v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
                dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch
                tl.store(dst + dims, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_rotary_inputs(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> None:
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


def apply_rotary_triton(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], any token/head strides
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [max_positions, head_dim] fp32: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (new contiguous tensors; the inputs are not modified)."""
    _check_rotary_inputs(positions, q, k, cache)
    if len({t.device for t in (positions, q, k, cache)}) != 1:
        raise ValueError("positions, q, k and cache must be on one device")
    q_out, k_out = (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )
    if q.shape[0] == 0:
        return q_out, k_out
    half = q.shape[2] // 2
    _rotary_kernel[(q.shape[0], 2)](
        positions, cache, q, k, q_out, k_out, q.shape[1], k.shape[1], cache.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        HALF=half, BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])),
        BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip
    return q_out, k_out


def rotary_write_kv_triton(
    positions: torch.Tensor,  # [num_tokens] int32/int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], any token/head strides
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any token/head strides
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], any token/head strides
    cache: torch.Tensor,  # [max_positions, head_dim] fp32: cos half, then sin half
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any dtype
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, -1 = padding (skipped)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] rotated q, contiguous
    """Rotated q; rotated k and unrotated v go into the caches in place, in one launch.

    Same contract as `apply_rotary_triton` followed by `write_kv_cache_triton`.
    """
    _check_rotary_inputs(positions, q, k, cache)
    check_kv_write(k, v, k_cache, v_cache, slot_mapping)
    if len({t.device for t in (positions, q, k, cache)}) != 1:
        raise ValueError("positions, q, k and cache must be on one device")
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    _rotary_write_kv_kernel[(num_tokens, 3)](
        positions, cache, slot_mapping, q, k, v, q_out, k_cache, v_cache,
        num_heads, k.shape[1], cache.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HALF=half, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip
    return q_out
