"""Triton kernels of the W4A16 / W8A16 dequant-GEMM for few tokens (M <= 64).

Same weight layout, split-K and zero-point algebra as `triton_quant_gemm`; two kernels built to
stream the weight at memory bandwidth:

- "fma" (M of 1 to a few): every packed value becomes an fp32 with two integer instructions per
  value at most, and one FMA consumes it. A value v shifted into mantissa bits [t, t + bits) of
  1.0 reads as 1 + v * 2**(t - 23); the activation, pre-multiplied by 2**(23 - t) (exact), turns
  the product into x * 2**(23 - t) + x * v, and the first term is subtracted once per K tile
  with the zero point. Placing each value with a shift of the whole word (three distinct shifts
  for 4 bits) and one AND-OR (a single LOP3) gives ~2.3 instructions per weight, all in the
  registers the word was loaded into: no layout conversion, no cross-thread reduction in the
  loop. t >= 12 keeps every product exact and the cancellation harmless (>= 13 bits survive).
  Token rows are programs next to each other on axis 0, so they share the weight tile in L2.
- "gemm_t" (M = 16..64): the tensor-core kernel with operands swapped, out^T = W^T x^T. The
  weight tile is the MMA's M side (64..256 rows fill a Hopper warpgroup MMA even for one token)
  and the token tile its N side (16..64), so no MMA row is wasted on padding tokens.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.kernels.triton_quant_gemm import (
    _load_group,
    _load_words,
    _source_k,
    _store_tile,
    _tile_offsets,
    _unpack,
)


@triton.jit
def _as_float(q, p: tl.constexpr, t: tl.constexpr, BITS: tl.constexpr):
    """Value p of each int32 word of q, placed at mantissa bit t -> fp32 1 + v * 2**(t - 23)."""
    shift: tl.constexpr = t - BITS * p
    if shift > 0:
        placed = q << shift
    elif shift < 0:
        # NOTE: an arithmetic shift; the mask drops the sign bits it brings in.
        placed = q >> -shift
    else:
        placed = q
    mask: tl.constexpr = ((1 << BITS) - 1) << t
    return ((placed & mask) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _wna16_fma_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, group_size, k_per_split, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """FMA kernel: program (tile, split) covers one token row and BLOCK_N outputs over
    k_per_split features; per-word partial sums stay in registers until after the loop."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PACK
    tile = tl.program_id(0)
    row = tile % M
    offs_n = (tile // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_KW)
    offs_p = tl.arange(0, PACK)
    acc = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_per_split
    for k0 in tl.range(k_begin, k_begin + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        q = _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS)  # [BLOCK_KW, BLOCK_N]
        src_k = k0 + offs_w[:, None] * PACK + offs_p[None, :]  # [BLOCK_KW, PACK]
        src_k = _source_k(perm_ptr, src_k, HAS_PERM)
        x = tl.load(x_ptr + row * stride_xm + src_k).to(tl.float32)  # [BLOCK_KW, PACK]
        part = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
        x_big = tl.zeros((BLOCK_KW,), dtype=tl.float32)  # sum of the pre-multiplied x
        for p in tl.static_range(PACK):
            # NOTE: mantissa bit 11, 15 or 19 (4 bits: three distinct shifts), 12 (8 bits).
            x_p = tl.sum(tl.where(offs_p[None, :] == p, x, 0.0), axis=1)  # [BLOCK_KW]
            x_p = x_p * (2 ** (12 - (8 - BITS) * (p % 3) - (BITS == 8)))
            x_big += x_p
            part += _as_float(q, p, 11 + (8 - BITS) * (p % 3) + (BITS == 8), BITS) * x_p[:, None]
        s, z = _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg)
        s = s.to(tl.float32)
        z = z.to(tl.float32)
        x_sum = tl.sum(x, axis=1)  # [BLOCK_KW]
        acc += (part - x_big[:, None] - x_sum[:, None] * z[None, :]) * s[None, :]
    total = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_N]
    offs_m = row + tl.arange(0, 1)
    _store_tile(
        total, offs_m, offs_n, offs_m >= 0, mask_n, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr,
        N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip


@triton.jit
def _wna16_gemm_t_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, group_size, k_per_split, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Swapped tensor-core kernel: acc^T [BLOCK_N, BLOCK_M] += W^T tile @ x^T tile.
    MAGIC (16-bit pattern) > 0: value v becomes OFFSET + v by bits (else OFFSET is 0)."""
    BLOCK_KW: tl.constexpr = BLOCK_K // (32 // BITS)
    tile = tl.program_id(0)
    offs_m, offs_n = _tile_offsets(tile, M, BLOCK_M, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_KW)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_per_split
    for k0 in tl.range(k_begin, k_begin + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        src_k = _source_k(perm_ptr, k0 + offs_k, HAS_PERM)
        x_t = tl.load(
            x_ptr + offs_m[None, :] * stride_xm + src_k[:, None], mask=mask_m[None, :], other=0.0
        )  # [BLOCK_K, BLOCK_M]
        q = _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS)  # [BLOCK_KW, BLOCK_N]
        s, z = _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg)
        s = s.to(tl.float32)
        # NOTE: OFFSET + v and OFFSET + z are small integers, exact in x's dtype, and so is
        # their difference: the zero point goes into the weight, and the MMA result needs only
        # the scale (no per-token sum of x, no [BLOCK_N, BLOCK_M] correction to re-layout).
        z = (z.to(tl.float32) + OFFSET).to(x_t.dtype)
        v = _unpack(q, BITS)  # [BLOCK_KW, PACK, BLOCK_N]
        if MAGIC > 0:
            w = (v | MAGIC).to(tl.int16).to(x_t.dtype, bitcast=True)
        else:
            w = v.to(x_t.dtype)
        w = tl.reshape(w, (BLOCK_K, BLOCK_N)) - z[None, :]  # [BLOCK_K, BLOCK_N]
        part = tl.dot(tl.trans(w), x_t, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        acc += part * s[:, None]
    _store_tile(
        tl.trans(acc), offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr,
        lock_ptr, N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
