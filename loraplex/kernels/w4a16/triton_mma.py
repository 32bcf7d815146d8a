"""The fused W4A16 / W8A16 tensor-core kernel ("mma"): y = x @ dequant(W) without a dense copy
of the weight, for every token count (layout: `types`; launch: the family's `__init__`).

The weight is the MMA's M side (acc^T [BLOCK_N, BLOCK_M] += W^T x^T): 64..256 weight rows fill
a Hopper warpgroup MMA even for one token, the tokens are its N side (16..256), and the
dequantized weight is the register operand, so it never goes through shared memory. Per tile of
`TILE_K` features and program:
- one load of the [BLOCK_N, words] word tile, K-contiguous: each thread reads the words of its
  MMA fragment as whole 128-bit lines (4 bits), staged through shared memory by the pipeline
  when NUM_STAGES > 1; the in-register "unshuffle" (reshape, permute) only renames registers;
- per position pair p (4 at 4 bits): one shift and one AND-OR per word give the bf16x2 / fp16x2
  register of two adjacent features (OFFSET + v by the magic-number bits), one packed subtract
  of OFFSET + z makes it v - z, exact; one dot of depth `pair_depth` with the contiguous x slice
  [p * depth, (p + 1) * depth) of the tile;
- the fp32 partial is scaled once per run of dots inside one group (`scale_dots`);
- split-K over programs, reduced by the shared epilogue (`triton_split_k`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.kernels.triton_split_k import store_split_k_tile
from loraplex.kernels.w4a16.triton_prologue import group_of, pair_operand, unshuffle_halves


@triton.jit(do_not_specialize=["M", "tiles_per_split", "SPLIT_K"])
def w4a16_mma_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    M, N, K, tiles_per_split, stride_xm, stride_qn, stride_sg, stride_om,
    GROUP_SIZE: tl.constexpr, SCALE_DOTS: tl.constexpr, BITS: tl.constexpr,
    MAGIC: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_ASM: tl.constexpr,
    SCALE_WEIGHTS: tl.constexpr, PREFETCH: tl.constexpr, TILE_K: tl.constexpr,
    LANES: tl.constexpr,
):  # fmt: skip
    """Program (tile, split) covers BLOCK_M tokens x BLOCK_N outputs over `tiles_per_split`
    layout tiles. MAGIC (16-bit pattern) > 0: value v becomes OFFSET + v by bits (else OFFSET
    is 0). The BLOCK_M tiles sharing a weight tile are consecutive programs (read once).
    SCALE_WEIGHTS: the scale multiplies the operand in x's dtype (one accumulator, no fp32
    partial per group: the large-tile form), else the fp32 partial of each run of dots.
    PREFETCH (one group per tile, SCALE_DOTS == pairs per word): the next tile's scales and zero
    points are loaded one iteration ahead (the pipeline stages only the words and activations;
    these plain loads otherwise stall every tile on a round trip to L2)."""
    HALF: tl.constexpr = 16 // BITS  # position pairs per word
    DEPTH: tl.constexpr = TILE_K // HALF  # features per pair = 16-bit halves per row and tile
    dtype = x_ptr.dtype.element_ty
    tile = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    offs_m = (tile % num_pid_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile // num_pid_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_d = tl.arange(0, DEPTH)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t_begin = tl.program_id(1) * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, tl.cdiv(K, TILE_K))
    AHEAD: tl.constexpr = PREFETCH and SCALE_DOTS == HALF
    if AHEAD:
        g = group_of(t_begin * TILE_K, K, GROUP_SIZE)
        z_next = tl.load(zeros_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
        s_next = tl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
    for t in tl.range(t_begin, t_end, num_stages=NUM_STAGES):
        if AHEAD:
            z_tile, s_tile = z_next, s_next
            # NOTE: past the last tile this reads the last group again (clamped), unused.
            g = group_of((t + 1) * TILE_K, K, GROUP_SIZE)
            z_next = tl.load(zeros_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
            s_next = tl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
        q = tl.load(
            qw_ptr + offs_n[:, None] * stride_qn + (t * DEPTH + offs_d)[None, :],
            mask=mask_n[:, None],
            other=0,
        )  # [BLOCK_N, DEPTH] int16 halves of the tile's words, slot order
        q = unshuffle_halves(q, BLOCK_N, DEPTH, LANES)
        if not SCALE_WEIGHTS:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for p in tl.static_range(HALF):
            k0 = t * TILE_K + p * DEPTH
            offs_k = k0 + offs_d
            mask_k = offs_k < K
            x_p = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )  # [BLOCK_M, DEPTH]
            if p % SCALE_DOTS == 0:
                if AHEAD:
                    z, s = z_tile, s_tile
                else:
                    g = group_of(k0, K, GROUP_SIZE)
                    z = tl.load(zeros_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
                    s = tl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
                # NOTE: OFFSET + z is a small integer, exact in x's dtype, and so is the
                # difference to OFFSET + v: the operand is the exact v - z.
                z = (z.to(tl.float32) + OFFSET).to(dtype)
            if SCALE_WEIGHTS:
                w = pair_operand(q, z, s.to(dtype), p, BITS, MAGIC, USE_ASM, True)
                acc = tl.dot(w, tl.trans(x_p), acc, input_precision=DOT_PRECISION)
            else:
                w = pair_operand(q, z, z, p, BITS, MAGIC, USE_ASM, False)  # [BLOCK_N, DEPTH]
                part = tl.dot(w, tl.trans(x_p), part, input_precision=DOT_PRECISION)
                if (p + 1) % SCALE_DOTS == 0:
                    acc += part * s.to(tl.float32)[:, None]
                    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    store_split_k_tile(
        tl.trans(acc), offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr,
        lock_ptr, N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
