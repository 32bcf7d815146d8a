"""Dequantization of the W4A16 / W8A16 layout to a dense [N, K] weight ("dequant": the prefill
route, where cuBLAS on the dense weight beats the fused kernel). One program per layout tile
and `BLOCK_N` rows; any group size dividing K."""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.kernels.w4a16.triton_prologue import group_of, pair_operand, unshuffle_halves


@triton.jit
def w4a16_dequant_kernel(
    qw_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, stride_qn, stride_sg, stride_on,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_K: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """out[n, k] = (q[n, k] - zero) * scale for the features k < K of tile program_id(0)."""
    HALF: tl.constexpr = 16 // BITS  # position pairs per word
    DEPTH: tl.constexpr = TILE_K // HALF  # features per pair = 16-bit halves per row and tile
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    q = tl.load(
        qw_ptr + offs_n[:, None] * stride_qn + (t * DEPTH + tl.arange(0, DEPTH))[None, :],
        mask=mask_n[:, None],
        other=0,
    )  # [BLOCK_N, DEPTH] int16 halves of the tile's words, slot order
    q = unshuffle_halves(q, BLOCK_N, DEPTH, LANES)
    for p in tl.static_range(HALF):
        k0 = t * TILE_K + p * DEPTH
        offs_k = k0 + tl.arange(0, DEPTH)
        mask_k = offs_k < K
        mask = mask_n[:, None] & mask_k[None, :]
        if GROUP_SIZE % DEPTH == 0:
            g = group_of(k0, K, GROUP_SIZE)
            s = tl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
            z = tl.load(zeros_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
            w = pair_operand(q, z.to(tl.float32), z, p, BITS, 0, False, False)
            w = w * s.to(tl.float32)[:, None]  # [BLOCK_N, DEPTH]
        else:
            g = group_of(offs_k, K, GROUP_SIZE)  # [DEPTH]
            group_ptrs = g[None, :] * stride_sg + offs_n[:, None]
            s = tl.load(scales_ptr + group_ptrs, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + group_ptrs, mask=mask, other=0.0).to(tl.float32)
            zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
            w = (pair_operand(q, zero, zero, p, BITS, 0, False, False) - z) * s
        out_ptrs = out_ptr + offs_n[:, None] * stride_on + offs_k[None, :]
        tl.store(out_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)
