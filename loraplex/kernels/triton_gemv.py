"""Triton GEMV for one token through a dense weight: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias).

Decode at batch 1 streams every weight once per step, so a projection is a pure memory read.
Each program owns BLOCK_N output rows and streams their [BLOCK_N, K] weight slab in BLOCK_K
chunks; there is no split over K, so no second pass and no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.gemv import GemvConfig


@triton.jit
def gemv_rows(x_row, w_ptr, rows, row_ok, K, stride_wn, EVEN_K: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """`sum_k x_row[k] * w[rows, k]` for `BLOCK_N` weight rows (fp32, 0 where not `row_ok`),
    streaming their slab in `BLOCK_K` chunks."""
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    x_ptrs = x_row + cols
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            k_ok = k0 + cols < K
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            w = tl.load(
                w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                eviction_policy="evict_first",
            )  # fmt: skip
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.sum(acc, axis=1)  # [BLOCK_N]


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    y = gemv_rows(x_ptr + m * stride_xm, w_ptr, rows, row_ok, K, stride_wn, EVEN_K, BLOCK_N,
                  BLOCK_K)  # fmt: skip
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv_triton(
    x: torch.Tensor,  # [M, K], M small (each row streams the whole weight)
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None,  # [N] or None
    config: GemvConfig,
) -> torch.Tensor:  # [M, N] in x's dtype
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x [M, K] and weight [N, K] disagree: {tuple(x.shape)} vs {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dimension")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}")
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, got {tuple(bias.shape)}")
    if x.device != weight.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, config.block_n), x.shape[0])
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else out, out, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
