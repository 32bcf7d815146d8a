"""The "stream" tensor-core kernel of the W4A16 / W8A16 dequant-GEMM for decode (M <= 64):
dispatch in `quant_gemm_configs`, layout in `quant_gemm_w4a16`.

Built to stream the packed weight with as few instructions per weight as Triton allows, so that
the M = 1..16 shapes become bound by memory rather than by the integer pipes:

- weight on the MMA's M side (acc^T [BLOCK_N, BLOCK_M] += W^T x^T): 64..256 weight columns fill
  an MMA even for one token; the token tile (16..64) is its N side;
- no K interleave: as in "sliced", value position p of every word of a [BLOCK_KW, BLOCK_N] word
  tile is one MMA operand, multiplied with the activation columns k0 + kw * PACK + p;
- two values per integer op: one AND (after one shift) of a word with 0x000F000F (4 bits) or
  0x00FF00FF (8 bits) isolates positions p and p + PACK / 2 in the low and high halves of the
  word; one OR with the magic pair (0x64006400 for fp16: 1024 + v; 0x43004300 for bf16 at 4
  bits: 128 + v) makes both halves 16-bit floats, read by a truncation and a 16-bit shift;
- the zero point and the magic offset leave the loop: sum_k x_k (OFFSET + v_k) - (OFFSET + z)
  sum_k x_k, exact integer weights times x, fp32 accumulation; the scale multiplies once per
  K tile (a K tile never crosses a group), as do the scale and zero loads;
- split-K with fp32 atomics (`_store_tile`), so few output tiles still keep every SM streaming.

JOIN_PAIRS ("stream_pair") makes the two halves of each masked word adjacent along K, one dot
of depth 2 * BLOCK_KW per pair of positions instead of two of BLOCK_KW: K index 2 * kw + h is
position p + h * PACK / 2 of word kw. A 16-bit MMA operand register holds two K-adjacent
values, so each such register is then the masked word itself, with no repacking across words
(sm_90 SASS: one LOP3 per two weights feeds the warpgroup MMA). Its activations are one
vectorized load of the K tile, split in registers into the pairs' operands.
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
def _half_of_pair(pair, HIGH: tl.constexpr, MAGIC: tl.constexpr, dtype: tl.constexpr):
    """The low (HIGH False) or high 16 bits of each int32 of `pair` as `dtype` values: the bits
    themselves when MAGIC (they already hold OFFSET + v), else the integer v converted."""
    if HIGH:
        half = pair >> 16
    elif MAGIC > 0:
        half = pair  # NOTE: the truncation to 16 bits below drops the high half.
    else:
        half = pair & 0xFFFF
    if MAGIC > 0:
        return half.to(tl.int16).to(dtype, bitcast=True)
    return half.to(dtype)


@triton.jit
def _dot_position(
    w, part, x_ptr, perm_ptr, k0, offs_w, offs_m, mask_m, stride_xm,
    P: tl.constexpr, PACK: tl.constexpr, HAS_PERM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """part^T += w^T x_p^T for value position P of the tile's words (x_p gathered)."""
    src_k = _source_k(perm_ptr, k0 + offs_w * PACK + P, HAS_PERM)  # [BLOCK_KW]
    x_t = tl.load(
        x_ptr + offs_m[None, :] * stride_xm + src_k[:, None], mask=mask_m[None, :], other=0.0
    )  # [BLOCK_KW, BLOCK_M]
    return tl.dot(tl.trans(w), x_t, part, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]


@triton.jit
def _dot_pair(
    w_lo, w_hi, x_p, part, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """part^T += [w_lo; w_hi interleaved along K]^T x_p^T: K index 2 * kw + h holds the high
    (h = 1) or low half of word kw; x_p [BLOCK_M, BLOCK_KW, 2] the activations they multiply."""
    w = tl.reshape(tl.join(tl.trans(w_lo), tl.trans(w_hi)), (BLOCK_N, 2 * BLOCK_KW))
    x_t = tl.trans(tl.reshape(x_p, (BLOCK_M, 2 * BLOCK_KW)))  # [2 * BLOCK_KW, BLOCK_M]
    return tl.dot(w, x_t, part, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]


@triton.jit
def _wna16_stream_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, group_size: tl.constexpr, k_per_split, stride_xm, stride_qk, stride_sg, stride_om,
    BITS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, JOIN_PAIRS: tl.constexpr,
):  # fmt: skip
    """Program (tile, split) covers BLOCK_M x BLOCK_N outputs over k_per_split features.
    MAGIC (16-bit pattern) > 0: each half of a masked pair becomes OFFSET + v by bits.
    group_size is a compile-time constant here: the group of a K tile is a shift, not a
    division, in the loop."""
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PACK // 2
    BLOCK_KW: tl.constexpr = BLOCK_K // PACK
    VALUE_MASK: tl.constexpr = (1 << BITS) - 1
    PAIR_MASK: tl.constexpr = VALUE_MASK | (VALUE_MASK << 16)
    MAGIC_PAIR: tl.constexpr = MAGIC | (MAGIC << 16)
    dtype = x_ptr.dtype.element_ty
    tile = tl.program_id(0)
    offs_m, offs_n = _tile_offsets(tile, M, BLOCK_M, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_KW)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_per_split
    for k0 in tl.range(k_begin, k_begin + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        q = _load_words(qw_ptr, k0, offs_w, offs_n, mask_n, stride_qk, BITS)  # [BLOCK_KW, BLOCK_N]
        s, z = _load_group(scales_ptr, zeros_ptr, k0, group_size, offs_n, mask_n, stride_sg)
        # The K tile of x, once, in feature order: feature kw * PACK + h * HALF + p is
        # [m, kw, h, p] of its reshapes below.
        src_k = _source_k(perm_ptr, k0 + offs_k, HAS_PERM)  # [BLOCK_K]
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + src_k[None, :], mask=mask_m[:, None], other=0.0
        )  # [BLOCK_M, BLOCK_K]
        x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
        if JOIN_PAIRS:
            # NOTE: tl.split takes the last dim of size 2: split p's bits, h stays last.
            if BITS == 4:
                x_e, x_o = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_KW, 2, 2, 2)))  # p & 1
                x_0, x_2 = tl.split(x_e)  # [BLOCK_M, BLOCK_KW, 2 (h)]
                x_1, x_3 = tl.split(x_o)
            else:
                x_0, x_1 = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_KW, 2, 2)))
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for p in tl.static_range(HALF):
            pair = (q >> (p * BITS)) & PAIR_MASK if p > 0 else q & PAIR_MASK
            if MAGIC > 0:
                pair = pair | MAGIC_PAIR
            w_lo = _half_of_pair(pair, False, MAGIC, dtype)  # position p [BLOCK_KW, BLOCK_N]
            w_hi = _half_of_pair(pair, True, MAGIC, dtype)  # position p + HALF
            if JOIN_PAIRS:
                if p == 0:
                    x_p = x_0
                elif p == 1:
                    x_p = x_1
                elif p == 2:
                    x_p = x_2
                else:
                    x_p = x_3
                part = _dot_pair(w_lo, w_hi, x_p, part, BLOCK_M, BLOCK_N, BLOCK_KW, DOT_PRECISION)
            else:
                part = _dot_position(
                    w_lo, part, x_ptr, perm_ptr, k0, offs_w, offs_m, mask_m, stride_xm,
                    p, PACK, HAS_PERM, DOT_PRECISION,
                )  # fmt: skip
                part = _dot_position(
                    w_hi, part, x_ptr, perm_ptr, k0, offs_w, offs_m, mask_m, stride_xm,
                    p + HALF, PACK, HAS_PERM, DOT_PRECISION,
                )  # fmt: skip
        zero = z.to(tl.float32) + OFFSET  # [BLOCK_N]
        acc += (part - zero[:, None] * x_sum[None, :]) * s.to(tl.float32)[:, None]
    _store_tile(
        tl.trans(acc), offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr,
        lock_ptr, N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
