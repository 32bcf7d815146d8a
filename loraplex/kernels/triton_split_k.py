"""The split-K epilogue shared by the quantized GEMM kernels (W4A16 `w4a16/triton_mma`, FP8
`triton_fp8_gemm_small_m`): programs that split K add fp32 partial tiles into the workspace of
`split_k`; the last program of a tile writes the output and zeroes the workspace again, so a
call is one launch."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_split_k_tile(
    acc, offs_m, offs_n, mask_m, mask_n, tile, bias_ptr, out_ptr, ws_ptr, lock_ptr,
    N, stride_om, HAS_BIAS: tl.constexpr, SPLIT_K,
):  # fmt: skip
    """Write an fp32 [BM, BN] tile; with split-K, reduce through the workspace first. SPLIT_K
    may be a compile-time constant or a run-time value (one compiled kernel for every split)."""
    mask = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += bias[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=mask, sem="release")
        tl.debug_barrier()
        # NOTE: the last of the SPLIT_K programs of this tile sees every partial.
        if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += bias[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(ws_ptrs, tl.zeros_like(total), mask=mask, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + tile, 0)
