"""The "sliced" tensor-core kernel of the W4A16 / W8A16 dequant-GEMM (dispatch:
`quant_gemm_configs`, layout: `quant_gemm_w4a16`).

The "gemm" and "gemm_t" kernels unpack a [BLOCK_KW, BLOCK_N] tile of int32 words into
[BLOCK_KW, PACK, BLOCK_N] values and reshape them to the [BLOCK_K, BLOCK_N] operand of one dot;
the reshape interleaves the PACK values of each word along K, a layout change Triton routes
through shared memory on every K step. A dot does not care in which order it visits K, as long
as both operands agree. So this kernel keeps the word tile's layout: for p in 0..PACK-1 it takes
value p of every word ([BLOCK_KW, BLOCK_N], one shift and one AND, in the registers the words
were loaded into) and multiplies it with the activation columns k0 + kw * PACK + p (a strided
gather of x, which sits in L1/L2). PACK dots of depth BLOCK_KW make the same MMA count as one
of depth BLOCK_K, and no layout is changed. BLOCK_KW must be >= 16 (a dot's minimum depth), so
BLOCK_K >= 128 at 4 bits and >= 64 at 8 bits.

SWAP puts the weight on the MMA's M side (acc^T [BLOCK_N, BLOCK_M] += W_p^T x_p^T): for a few
tokens, 64..256 weight columns fill a Hopper warpgroup MMA, the dequantized weight is its
register operand, and only the small x tile goes through shared memory.

Measured on the H200 (benchmarks/results/h200_quant.json): "sliced_t" is the fastest kernel at
M = 4 (1.5-1.8x the FMA kernel, 1.3-1.6x "gemm"), 5-16% behind "gemm" at M = 16, and behind
"gemm_t" from M = 32; the non-swapped form loses everywhere above M = 16 (its strided x gathers
cost more than the layout change it saves).
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
)


@triton.jit
def _wna16_sliced_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, group_size, k_per_split, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (tile, split) covers BLOCK_M x BLOCK_N outputs over k_per_split features.
    MAGIC (16-bit pattern) > 0: value v becomes OFFSET + v by bits (else OFFSET is 0)."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PACK
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    dtype = x_ptr.dtype.element_ty
    tile = tl.program_id(0)
    offs_m, offs_n = _tile_offsets(tile, M, BLOCK_M, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_KW)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_per_split
    for k0 in tl.range(k_begin, k_begin + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        q = _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS)  # [BLOCK_KW, BLOCK_N]
        s, z = _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg)
        # NOTE: OFFSET + v and OFFSET + z are small integers, exact in x's dtype, and so is
        # their difference: the zero point goes into the weight, the result needs only the scale.
        z = (z.to(tl.float32) + OFFSET).to(dtype)
        if SWAP:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(PACK):
            src_k = _source_k(perm_ptr, k0 + offs_w * PACK + p, HAS_PERM)  # [BLOCK_KW]
            v = (q >> (p * BITS)) & VALUE_MASK if p > 0 else q & VALUE_MASK
            if MAGIC > 0:
                w = (v | MAGIC).to(tl.int16).to(dtype, bitcast=True)
            else:
                w = v.to(dtype)
            w = w - z[None, :]  # [BLOCK_KW, BLOCK_N]
            if SWAP:
                x_t = tl.load(
                    x_ptr + offs_m[None, :] * stride_xm + src_k[:, None],
                    mask=mask_m[None, :],
                    other=0.0,
                )  # [BLOCK_KW, BLOCK_M]
                part = tl.dot(tl.trans(w), x_t, part, input_precision=DOT_PRECISION)
            else:
                x_p = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + src_k[None, :],
                    mask=mask_m[:, None],
                    other=0.0,
                )  # [BLOCK_M, BLOCK_KW]
                part = tl.dot(x_p, w, part, input_precision=DOT_PRECISION)
        if SWAP:
            acc += part * s.to(tl.float32)[:, None]
        else:
            acc += part * s.to(tl.float32)[None, :]
    if SWAP:
        acc = tl.trans(acc)
    _store_tile(
        acc, offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr,
        N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
