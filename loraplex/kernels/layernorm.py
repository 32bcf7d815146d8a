"""RMSNorm, optionally fused with the residual add that precedes it: Triton on CUDA, C for fp32
on CPU (`cpu_norm`), torch otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_norm


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(new_residual, weight, eps), new_residual


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref` in C for fp32 rows (`cpu_norm`), else as torch's RMSNorm op (one op
    instead of six per call)."""
    # x: [num_tokens, hidden]; .float() is the tensor itself when it is fp32 already
    if cpu_norm.supports(x, weight):
        done = cpu_norm.rms_norm_c(x, weight, eps)
        if done is not None:
            return done[0]
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight in fp32 math, returned in x's dtype; Triton on CUDA."""
    if x.is_cuda:
        from loraplex.kernels.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_cpu(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) as new tensors; inputs are not modified."""
    if x.is_cuda:
        from loraplex.kernels.triton_norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if cpu_norm.supports(x, weight, residual):
        done = cpu_norm.rms_norm_c(x, weight, eps, residual)
        if done is not None and done[1] is not None:
            return done[0], done[1]
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_cpu(new_residual, weight, eps), new_residual
