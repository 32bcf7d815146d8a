"""The FP8 W8A8 decode kernel (M <= 32 tokens) with the activation quantization fused in
(wrapper, checks and reference: `fp8_gemm`).

At a few tokens the GEMM is a stream of the FP8 weight [N, K] through the GPU: the kernel
must keep every SM busy and spend nothing on the activations. So:
- the weight sits on the MMA's M side (acc^T [BLOCK_N, BLOCK_M] += W tile @ x_q tile^T): 64..256
  weight rows fill a Hopper warpgroup MMA even for one token, and both FP8 operands are
  K-contiguous as the FP8 MMA wants them;
- split-K spreads K over programs so that a few thousand output columns still fill 132 SMs; the
  partial tiles are reduced through the shared split-K epilogue (`triton_split_k`);
- the activations arrive in bf16/fp16 and are quantized inside the kernel, never written as
  FP8: per token (per-channel weights) each program first takes the amax of its token rows over
  all of K (a few KB read from L2 at these M, in as few wide reads as registers allow), then
  scales and casts each K tile in registers;
  with 128x128 block weights the scale of a K tile is its own amax (BLOCK_K is the scale block),
  so nothing is read twice; a static per-tensor input scale skips the amax.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.kernels.triton_split_k import store_split_k_tile


@triton.jit
def _row_scales(
    x_ptr, offs_m, M, K, stride_xm, FP8_MAX, MIN_SCALE,
    ROWS: tl.constexpr, ROW_COLS: tl.constexpr,
):  # fmt: skip
    """Per-token scales [BLOCK_M]: amax over all K of each row / FP8_MAX.

    NOTE: this pass is a chain of dependent L2 reads ahead of the main loop, so it reads as
    wide a [ROWS, ROW_COLS] tile as the registers allow (ROWS = M rounded up, not the padded
    token tile): one or two reads at M = 1 instead of K / BLOCK_K."""
    offs_r = tl.arange(0, ROWS)
    offs_c = tl.arange(0, ROW_COLS)
    mask_r = offs_r < M
    amax = tl.zeros((ROWS, ROW_COLS), dtype=tl.float32)
    for k0 in range(0, K, ROW_COLS):
        mask = mask_r[:, None] & (k0 + offs_c < K)[None, :]
        x = tl.load(
            x_ptr + offs_r[:, None] * stride_xm + (k0 + offs_c)[None, :], mask=mask, other=0.0
        )
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    rows = tl.max(amax, axis=1)  # [ROWS]
    # Row r of the padded token tile takes rows[r] (rows past M: the minimum scale).
    picked = tl.where(offs_m[:, None] == offs_r[None, :], rows[None, :], 0.0)  # [BLOCK_M, ROWS]
    return tl.maximum(tl.max(picked, axis=1), MIN_SCALE) / FP8_MAX


@triton.jit
def _fp8_small_m_kernel(
    x_ptr, w_ptr, ws_ptr, in_scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_wsn, stride_om,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    STATIC_INPUT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, ROWS: tl.constexpr, ROW_COLS: tl.constexpr,
):  # fmt: skip
    """Program (n tile, split) computes out[:M, n tile] over k_per_split features.

    BLOCK_SCALES: w_scale [N, K / BLOCK_K] and per-(token, K tile) activation scales; else
    w_scale [N, 1] and per-token scales (or the static `in_scale_ptr` scalar)."""
    tile = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    fp8 = w_ptr.dtype.element_ty
    if not BLOCK_SCALES:
        if STATIC_INPUT:
            x_scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(in_scale_ptr)
        else:
            x_scale = _row_scales(
                x_ptr, offs_m, M, K, stride_xm, FP8_MAX, MIN_SCALE, ROWS, ROW_COLS
            )
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        mask_k = k0 + offs_k < K
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K] fp8
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        if BLOCK_SCALES:
            tile_scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_SCALE) / FP8_MAX  # [BLOCK_M]
            x_q = tl.clamp(x / tile_scale[:, None], -FP8_MAX, FP8_MAX).to(fp8)
            part = tl.dot(w, tl.trans(x_q))  # [BLOCK_N, BLOCK_M]
            w_s = tl.load(ws_ptr + offs_n * stride_wsn + k0 // BLOCK_K, mask=mask_n, other=0.0)
            acc += part * w_s[:, None] * tile_scale[None, :]
        else:
            x_q = tl.clamp(x / x_scale[:, None], -FP8_MAX, FP8_MAX).to(fp8)
            # NOTE: a fresh dot per K tile, added in fp32: Hopper's FP8 MMA accumulates with
            # fewer bits than fp32, so the running sum is not chained through it.
            acc += tl.dot(w, tl.trans(x_q))
    if not BLOCK_SCALES:
        w_s = tl.load(ws_ptr + offs_n * stride_wsn, mask=mask_n, other=0.0)
        acc = acc * w_s[:, None] * x_scale[None, :]
    store_split_k_tile(
        tl.trans(acc), offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, part_ptr,
        lock_ptr, N, stride_om, HAS_BIAS, SPLIT_K,
    )  # fmt: skip
