"""W4A16 / W8A16 GEMM: y = x @ dequant(W) for AWQ and GPTQ weights in the layout of `types`
(repacked at load by `loraplex.quant.w4a16_repack`).

On CUDA `w4a16_gemm` runs the launch `dispatch.select_config` picks for the token count:
- "mma" / "mma_wscale" (`triton_mma`): the fused tensor-core kernel, weight on the MMA's M side,
  dequantized in registers, split-K when the output tiles alone do not fill the GPU;
- "dequant" (`triton_dequant`): dequantize the whole weight once into a reused buffer and run
  cuBLAS on it (prefill, where the dense GEMM's speed pays for the extra pass). Also the route
  of group sizes the fused kernel cannot scale per dot (`types.scale_dots`).
Elsewhere the plain-torch reference (`reference`) runs.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from loraplex.kernels.split_k import fit_split_k, num_sms, retain, split_k_workspace
from loraplex.kernels.w4a16.dispatch import select_config
from loraplex.kernels.w4a16.reference import w4a16_gemm_reference
from loraplex.kernels.w4a16.triton_dequant import w4a16_dequant_kernel
from loraplex.kernels.w4a16.triton_mma import w4a16_mma_kernel
from loraplex.kernels.w4a16.types import (
    FRAGMENT_LANES,
    TILE_K,
    W4A16Config,
    pack_factor,
    padded_k,
    scale_dots,
)

__all__ = ["kernel_name", "w4a16_dequantize", "w4a16_gemm", "w4a16_gemm_triton"]

_DEQUANT: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> None:
    pack = pack_factor(bits)
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be 2-D fp16/bf16/fp32, got {tuple(x.shape)} {x.dtype}")
    k = x.shape[1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide K={k}")
    groups, n = k // group_size, qweight.shape[0]
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (n, padded_k(k) // pack):
        raise ValueError(
            f"qweight must be int32 [N, {padded_k(k) // pack}] for K={k}, "
            f"got {tuple(qweight.shape)} {qweight.dtype}"
        )
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (groups, n) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be float [{groups}, {n}], got {tuple(t.shape)}")
    if perm is not None and (perm.dtype != torch.int32 or tuple(perm.shape) != (k,)):
        raise ValueError(f"perm must be int32 [{k}], got {tuple(perm.shape)} {perm.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if any(t.stride(-1) != 1 for t in (qweight, scales, zeros)):
        raise ValueError("qweight, scales and zeros must be contiguous in their last dim")
    tensors = [t for t in (x, qweight, scales, zeros, perm, bias) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x and the weight tensors must be on one device")


def _magic(dtype: torch.dtype, bits: int) -> tuple[int, float]:
    """16-bit pattern whose low mantissa bits take an integer value, and the value it adds."""
    if dtype == torch.float16:
        return 0x6400, 1024.0
    if dtype == torch.bfloat16 and bits == 4:
        return 0x4300, 128.0
    return 0, 0.0


def _dequant_buffer(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat [>= numel] buffer of `dtype`, reused layer after layer."""
    buf = _DEQUANT.get((device, dtype))
    if buf is None or buf.numel() < numel:
        if buf is not None:
            retain(buf)
        buf = torch.empty(numel, dtype=dtype, device=device)
        _DEQUANT[(device, dtype)] = buf
    return buf


def _launch_dequant(qweight, scales, zeros, group_size, bits, out, block_n, warps) -> None:
    n, k = out.shape
    halves = qweight.view(torch.int16)  # [N, 2 * K_pad / pack]
    w4a16_dequant_kernel[(triton.cdiv(k, TILE_K), triton.cdiv(n, block_n))](
        halves, scales, zeros, out, n, k, halves.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_N=block_n, TILE_K=TILE_K,
        LANES=FRAGMENT_LANES, num_warps=warps,
    )  # fmt: skip


def w4a16_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Triton dequantization to a dense weight [N, K] of `dtype`, features in weight order."""
    k = scales.shape[0] * group_size
    out = torch.empty(qweight.shape[0], k, dtype=dtype, device=qweight.device)
    _launch_dequant(qweight, scales, zeros, group_size, bits, out, 64, 4)
    return out


def _dequant_matmul(x, qweight, scales, zeros, group_size, bits, bias, config):
    """Dequantize the weight into the reused buffer, then cuBLAS (x in weight row order)."""
    n, k = qweight.shape[0], x.shape[1]
    w = _dequant_buffer(x.device, n * k, x.dtype)[: n * k].view(n, k)  # [N, K]
    _launch_dequant(qweight, scales, zeros, group_size, bits, w, config.block_n, config.num_warps)
    return torch.nn.functional.linear(x, w, bias)


def resolve(config: W4A16Config, m: int, n: int, k: int, group_size: int, bits: int,
            sms: int) -> W4A16Config:  # fmt: skip
    """Make a config launchable at this shape: a concrete split_k for the fused kernel;
    "dequant" where it cannot scale this group size."""
    if config.kind == "dequant":
        return config
    if scale_dots(group_size, k, bits) == 0:
        return W4A16Config("dequant", 16, 64, 1, 4, 1)
    if config.split_k:
        return config
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    split = fit_split_k(tiles, triton.cdiv(k, TILE_K), sms)
    return replace(config, split_k=split)


def w4a16_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: W4A16Config | None = None,
) -> torch.Tensor:
    """The Triton path: x [M, K] -> [M, N] in x's dtype, with `config` or the selected one."""
    _check_inputs(x, qweight, scales, zeros, group_size, bits, perm, bias)
    (m, k), n = x.shape, qweight.shape[0]
    if config is None:
        config = select_config(m, n, k, bits)
    config = resolve(config, m, n, k, group_size, bits, num_sms(x.device))
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    if perm is not None:
        # NOTE: act-order: the activations are gathered into the weight's row order once, and
        # the plain kernel runs. A gather inside the fused kernel (an address loaded per tile)
        # kept the pipeline from prefetching: GPTQ act-order decoded at 1.22x bf16's time per
        # token on the H200 against AWQ's 0.67x, and served 256 sequences at 0.23x bf16.
        x = x.index_select(1, perm)  # [M, K], features in weight row order
    x = x if x.stride(1) == 1 else x.contiguous()
    if config.kind == "dequant":
        return _dequant_matmul(x, qweight, scales, zeros, group_size, bits, bias, config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_tiles = triton.cdiv(k, TILE_K)
    tiles_per_split = triton.cdiv(k_tiles, config.split_k)
    split = triton.cdiv(k_tiles, tiles_per_split)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    ws, locks = split_k_workspace(x.device, m * n if split > 1 else 1, tiles)
    magic, offset = _magic(x.dtype, bits)
    halves = qweight.view(torch.int16)  # [N, 2 * K_pad / pack]
    w4a16_mma_kernel[(tiles, split)](
        x, halves, scales, zeros, bias if bias is not None else scales, out, ws, locks,
        m, n, k, tiles_per_split, x.stride(0), halves.stride(0), scales.stride(0), out.stride(0),
        GROUP_SIZE=group_size, SCALE_DOTS=scale_dots(group_size, k, bits), BITS=bits,
        MAGIC=magic, OFFSET=offset, HAS_BIAS=bias is not None,
        SPLIT_K=split, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        NUM_STAGES=config.num_stages, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_ASM=x.is_cuda and magic > 0, SCALE_WEIGHTS=config.kind == "mma_wscale", PREFETCH=config.prefetch, TILE_K=TILE_K, LANES=FRAGMENT_LANES, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(W) (+ bias): x [M, K] fp16/bf16 (fp32 on CPU) -> [M, N] in x's dtype.

    On CUDA runs the launch `select_config` picks for M; elsewhere the torch reference."""
    _check_inputs(x, qweight, scales, zeros, group_size, bits, perm, bias)
    if not x.is_cuda:
        return w4a16_gemm_reference(x, qweight, scales, zeros, group_size, bits, perm, bias)
    return w4a16_gemm_triton(x, qweight, scales, zeros, group_size, bits, perm, bias)


def kernel_name(m: int, n: int, k: int, group_size: int, bits: int) -> str:
    """Which launch `w4a16_gemm` runs on CUDA for M tokens (for logs, benchmarks)."""
    sms = num_sms(torch.device("cuda"))
    c = resolve(select_config(m, n, k, bits), m, n, k, group_size, bits, sms)
    if c.kind == "dequant":
        return f"dequant(bn {c.block_n}, w{c.num_warps})+cuBLAS"
    ahead = ", prefetch" if c.prefetch else ""
    return (
        f"{c.kind}({c.block_m}x{c.block_n}, split {c.split_k}, w{c.num_warps}, "
        f"s{c.num_stages}{ahead})"
    )
