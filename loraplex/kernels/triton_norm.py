"""Triton RMSNorm, alone or fused with the residual add before it (one row per program)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, hidden, eps,
    stride_x, stride_r, stride_o, stride_ro, ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # NOTE: the sum is rounded to the input dtype before normalising, as the reference does,
        # so the residual stream the next layer sees is the one that was normalised.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, (xf * inv_rms * w).to(x_ptr.dtype.element_ty), mask=mask
    )


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} must be [hidden] for x {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")
    if weight.device != x.device or weight.stride(0) != 1:
        raise ValueError("weight must be contiguous and on the device of x")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(
    x2: torch.Tensor, residual2: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x2)
    residual_out = torch.empty_like(x2) if residual2 is not None else out
    rows, hidden = x2.shape
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    r = residual2 if residual2 is not None else x2
    _rms_norm_kernel[(rows,)](
        x2, r, weight, out, residual_out, hidden, eps,
        x2.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
        ADD_RESIDUAL=residual2 is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, residual_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> RMSNorm(x) * weight, fp32 math, a new tensor of x's dtype."""
    out, _ = _launch(_rows(x, weight), None, weight, eps)
    return out.view(x.shape)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; inputs are not modified."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {residual.dtype} {tuple(residual.shape)} must match x "
            f"{x.dtype} {tuple(x.shape)}"
        )
    out, new_residual = _launch(_rows(x, weight), _rows(residual, weight), weight, eps)
    return out.view(x.shape), new_residual.view(x.shape)
