"""Triton Philox noise: the uniforms `reference.philox_uniform_ref` computes, bit for bit, as a jit
helper the sampling kernels call in registers, and as a kernel that writes them out (tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.sampling.types import UNIFORM_OFFSET, UNIFORM_SCALE, UNIFORM_SHIFT

_SHIFT = tl.constexpr(UNIFORM_SHIFT)
_SCALE = tl.constexpr(UNIFORM_SCALE)
_OFFSET = tl.constexpr(UNIFORM_OFFSET)


@triton.jit
def philox_uniform(seed, step, token):
    """Uniforms in [2**-24, 1 - 2**-24] of `token` (an int block) for one (seed, step): int64
    scalars. Philox4x32-10 (Triton's) of counter (token // 4, step_lo, step_hi, 0) under key
    seed; token t takes output word t % 4."""
    c0 = (token // 4).to(tl.uint32)
    zero = tl.zeros_like(c0)
    c1 = zero + (step & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    x0, x1, x2, x3 = tl.philox(seed, c0, c1, c2, zero, 10)
    word = token % 4
    x = tl.where(word == 0, x0, tl.where(word == 1, x1, tl.where(word == 2, x2, x3)))
    return (x >> _SHIFT).to(tl.float32) * _SCALE + _OFFSET


@triton.jit
def _uniform_kernel(seed_ptr, step_ptr, out_ptr, vocab, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    token = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    u = philox_uniform(seed, step, token)
    tl.store(out_ptr + row * stride_o + token, u, mask=token < vocab)


def philox_uniform_triton(
    seeds: torch.Tensor,  # [n] int64
    steps: torch.Tensor,  # [n] int64
    vocab: int,
) -> torch.Tensor:
    """`philox_uniform_ref` in Triton. -> [n, vocab] fp32 on the seeds' device"""
    if seeds.dim() != 1 or seeds.shape != steps.shape:
        raise ValueError(f"seeds and steps must be [n], got {seeds.shape}, {steps.shape}")
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64:
        raise ValueError(f"seeds and steps must be int64, got {seeds.dtype}, {steps.dtype}")
    if not 0 < vocab < 2**31:
        raise ValueError(f"vocab must be in [1, 2**31), got {vocab}")
    n = seeds.shape[0]
    out = torch.empty(n, vocab, dtype=torch.float32, device=seeds.device)
    block = 1024
    if n:
        _uniform_kernel[(n, triton.cdiv(vocab, block))](
            seeds.contiguous(), steps.contiguous(), out, vocab, out.stride(0), BLOCK=block
        )
    return out
