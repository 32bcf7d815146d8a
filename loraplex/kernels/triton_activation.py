"""Triton SiLU-and-mul: silu(gate) * up over the merged gate-up projection output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, intermediate, stride_xt, stride_ot, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + intermediate + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + token * stride_ot + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * intermediate] (gate then up) -> [..., intermediate], fp32 math."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"last dimension must be 2 * intermediate, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")
    intermediate = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], intermediate, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and intermediate > 0:
        grid = (x2.shape[0], triton.cdiv(intermediate, BLOCK))
        _silu_and_mul_kernel[grid](x2, out, intermediate, x2.stride(0), out.stride(0), BLOCK=BLOCK)
    return out.view(*x.shape[:-1], intermediate)
