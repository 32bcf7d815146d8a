"""FP8 W8A8 GEMM (e4m3): y = (x_q * x_scale) @ (w_q * w_scale)^T.

Two scale layouts:
- per-token x per-channel: `x_scale` [M, 1], `w_scale` [N, 1]; the product is scaled once,
  after the K loop;
- blocks along K (DeepSeek-style 128x128 weight blocks): `x_scale` [M, KB] per token and
  K-block of `block_k` features, `w_scale` [N, KB] per output row and K-block (128x128 block
  scales are expanded to rows at load by `expand_block_scales`, which also serves merged layers
  whose shards are not multiples of the block); each K-block's partial product is scaled.

Activations are quantized on the fly: dynamically (amax per token, or per token and K-block)
or with a static per-tensor `input_scale`. On CUDA `fp8_linear` runs, by token count M:
- a few tokens (`fp8_decode_config`: the tuned table, else M <= `FP8_SMALL_M_MAX`): the decode
  kernel of `triton_fp8_gemm_small_m` (weight on the MMA's M side, split-K, activation
  quantization fused in: one launch);
- above, per-channel scales in bf16: the Triton activation quantization and `torch._scaled_mm`
  with row-wise scales (cuBLASLt's FP8 GEMM); otherwise the Triton GEMM of this module.
Elsewhere the torch references run (CPU torch supports float8_e4m3fn tensors and casts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.split_k import fit_split_k, num_sms, split_k_workspace
from loraplex.kernels.triton_fp8_gemm_small_m import _fp8_small_m_kernel

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
_MIN_SCALE = 1e-12

#: The most tokens the fused decode kernel takes (its token tile holds up to 32 rows).
FP8_DECODE_MAX_M = 32

#: Up to this many tokens, an [N, K] without a tuned entry runs the decode kernel on CUDA.
FP8_SMALL_M_MAX = 16


@dataclass(frozen=True)
class Fp8DecodeConfig:
    """One launch of the FP8 decode kernel: output rows per program, K tile (the scale block
    with block scales), split-K (0: about two programs per SM), warps and loop stages."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_k < 0 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"bad split_k / num_warps / num_stages in {self}")


#: (M bucket, N, K) -> measured best decode config on the H200 (per-channel scales), or None
#: where Triton quantization + `torch._scaled_mm` measured faster; pasted from the FP8 decode
#: sweep of `benchmarks.quant_gemm` at 9732be6 (its h200_quant.json in that commit's history;
#: the benchmark has timed only the dispatched FP8 path since a8e4623).
FP8_TUNED_CONFIGS: dict[tuple[int, int, int], Fp8DecodeConfig | None] = {
    (1, 6144, 4096): Fp8DecodeConfig(64, 256, 0, 4, 3),
    (4, 6144, 4096): Fp8DecodeConfig(64, 256, 0, 4, 3),
    (16, 6144, 4096): Fp8DecodeConfig(64, 256, 0, 4, 3),
    (32, 6144, 4096): None,
    (1, 4096, 4096): None,
    (4, 4096, 4096): None,
    (16, 4096, 4096): None,
    (32, 4096, 4096): None,
    (1, 28672, 4096): Fp8DecodeConfig(256, 128, 0, 8, 3),
    (4, 28672, 4096): Fp8DecodeConfig(256, 128, 0, 8, 3),
    (16, 28672, 4096): Fp8DecodeConfig(64, 128, 0, 4, 4),
    (32, 28672, 4096): None,
    (1, 4096, 14336): Fp8DecodeConfig(256, 128, 0, 8, 3),
    (4, 4096, 14336): Fp8DecodeConfig(256, 128, 0, 8, 3),
    (16, 4096, 14336): None,
    (32, 4096, 14336): None,
}

#: Token counts the FP8 decode table is keyed by; M uses the smallest bucket >= M.
FP8_M_BUCKETS = (1, 4, 16, 32)


def fp8_decode_config(m: int, n: int, k: int) -> Fp8DecodeConfig | None:
    """The decode kernel's config for M tokens of an [N, K] weight: the tuned entry, else the
    default up to `FP8_SMALL_M_MAX` tokens; None: the `_scaled_mm` path is the faster one."""
    if m > FP8_DECODE_MAX_M:
        return None
    bucket = next(b for b in FP8_M_BUCKETS if m <= b)
    if (bucket, n, k) in FP8_TUNED_CONFIGS:
        return FP8_TUNED_CONFIGS[(bucket, n, k)]
    if m > FP8_SMALL_M_MAX:
        return None
    # NOTE: the kinds of winners of the H200 sweep: wide tiles for 1-4 tokens, narrow above.
    return Fp8DecodeConfig(256, 128, 0, 8, 3) if m <= 4 else Fp8DecodeConfig(64, 128, 0, 4, 4)


@triton.jit
def _quant_fp8_group_kernel(
    x_ptr, q_ptr, s_ptr, K, group_size, stride_xm, stride_qm, stride_sm,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    group = tl.program_id(1)
    offs = group * group_size + tl.arange(0, BLOCK)
    mask = (offs < K) & (offs < (group + 1) * group_size)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)), MIN_SCALE) / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group, scale)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn, stride_bsk,
    stride_om, stride_on,
    SCALE_BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_in_group = GROUP_M * num_pid_n
    first_m = (pid // pids_in_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % pids_in_group) % group_rows
    pid_n = (pid % pids_in_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K] fp8
        b = tl.load(
            b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] fp8, K-major
        if SCALE_BLOCK_K > 0:
            kb = k0 // SCALE_BLOCK_K
            a_s = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask, mask=mask_m, other=0.0)
            b_s = tl.load(bs_ptr + offs_n * stride_bsn + kb * stride_bsk, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
    if SCALE_BLOCK_K == 0:
        a_s = tl.load(as_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptr + offs_n * stride_bsn, mask=mask_n, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def quantize_fp8_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of x [M, K] per token and group of `group_size` features.

    Returns (x_q [M, K] float8_e4m3fn, scales [M, ceil(K / group_size)] fp32)."""
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - k))
    padded = padded.view(m, groups, group_size)
    scales = padded.abs().amax(dim=-1).clamp(min=_MIN_SCALE) / FP8_MAX  # [M, groups]
    q = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8_DTYPE), scales


def quantize_fp8_triton(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_fp8_reference` (x's last dim must be contiguous)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got {tuple(x.shape)}")
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    block = triton.next_power_of_2(group_size)
    _quant_fp8_group_kernel[(m, groups)](
        x, q, scales, k, group_size, x.stride(0), q.stride(0), scales.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return q, scales


def quantize_fp8_static(
    x: torch.Tensor, input_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [M, K] with one static scale: (x_q [M, K], scales [M, 1])."""
    scale = input_scale.float().reshape(1, 1)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.expand(x.shape[0], 1)


def expand_block_scales(scale_inv: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """Block scales [ceil(rows / block_n), KB] -> one row per output feature [rows, KB]."""
    if scale_inv.shape[0] != triton.cdiv(rows, block_n):
        raise ValueError(
            f"{scale_inv.shape[0]} block rows do not cover {rows} outputs in blocks of {block_n}"
        )
    return scale_inv.float().repeat_interleave(block_n, dim=0)[:rows].contiguous()


def fp8_gemm_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Plain-torch W8A8 GEMM in fp32: dequantize both sides and multiply."""
    k = x_q.shape[1]
    step = k if block_k is None else block_k
    x = x_q.float() * x_scale.float().repeat_interleave(step, dim=1)[:, :k]  # [M, K]
    w = w_q.float() * w_scale.float().repeat_interleave(step, dim=1)[:, :k]  # [N, K]
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _check_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int | None,
    bias: torch.Tensor | None,
) -> None:
    if x_q.dtype != FP8_DTYPE or w_q.dtype != FP8_DTYPE:
        raise ValueError(f"x_q and w_q must be {FP8_DTYPE}, got {x_q.dtype} and {w_q.dtype}")
    if x_q.dim() != 2 or w_q.dim() != 2 or x_q.shape[1] != w_q.shape[1]:
        raise ValueError(
            f"x_q [M, K] and w_q [N, K] disagree: {tuple(x_q.shape)}, {tuple(w_q.shape)}"
        )
    (m, k), n = x_q.shape, w_q.shape[0]
    kb = 1 if block_k is None else triton.cdiv(k, block_k)
    if tuple(x_scale.shape) != (m, kb) or tuple(w_scale.shape) != (n, kb):
        raise ValueError(
            f"scales must be [{m}, {kb}] and [{n}, {kb}], "
            f"got {tuple(x_scale.shape)} and {tuple(w_scale.shape)}"
        )
    if x_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError("scales must be float32")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def fp8_gemm_triton(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton W8A8 GEMM: x_q [M, K], w_q [N, K] (float8_e4m3fn) -> [M, N] of out_dtype."""
    _check_gemm(x_q, x_scale, w_q, w_scale, block_k, bias)
    (m, k), n = x_q.shape, w_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    if block_k is not None and (block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if m <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    bk = 128 if block_k is None else min(128, block_k)
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_gemm_kernel[grid](
        x_q, w_q, x_scale, w_scale, bias if bias is not None else w_scale, out, m, n, k,
        x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1),
        x_scale.stride(0), x_scale.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), out.stride(1),
        SCALE_BLOCK_K=0 if block_k is None else block_k, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=8,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def fp8_small_m_reference(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int | None,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """What the fused decode kernel computes, in plain torch: quantize x, then the W8A8 GEMM."""
    if input_scale is not None:
        x_q, x_scale = quantize_fp8_static(x, input_scale)
    else:
        x_q, x_scale = quantize_fp8_reference(x, x.shape[1] if block_k is None else block_k)
    return fp8_gemm_reference(x_q, x_scale, w_q, w_scale, block_k, bias, x.dtype)


def fp8_small_m_triton(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    block_k: int | None,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    config: Fp8DecodeConfig | None = None,
) -> torch.Tensor:
    """The fused decode kernel: x [M, K] (bf16/fp16/fp32, M <= `FP8_DECODE_MAX_M`) quantized in
    the kernel, w_q [N, K] float8_e4m3fn -> [M, N] in x's dtype. With block scales the K tile is
    the scale block (`block_k`, a power of two in [32, 256])."""
    if x.dim() != 2 or x.shape[0] > FP8_DECODE_MAX_M or x.stride(1) != 1:
        raise ValueError(
            f"x must be [M <= {FP8_DECODE_MAX_M}, K] with contiguous rows, got {tuple(x.shape)}"
        )
    (m, k), n = x.shape, w_q.shape[0]
    kb = 1 if block_k is None else triton.cdiv(k, block_k)
    if w_q.dtype != FP8_DTYPE or w_q.dim() != 2 or w_q.shape[1] != k or w_q.stride(1) != 1:
        raise ValueError(f"w_q must be {FP8_DTYPE} [N, {k}] row-major, got {tuple(w_q.shape)}")
    if tuple(w_scale.shape) != (n, kb) or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be float32 [{n}, {kb}], got {tuple(w_scale.shape)}")
    if block_k is not None and (block_k < 32 or block_k > 256 or block_k & (block_k - 1)):
        raise ValueError(f"the decode kernel takes block_k a power of two in [32, 256]: {block_k}")
    if input_scale is not None and block_k is not None:
        raise ValueError("block scales take dynamic activation scales, not an input_scale")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    config = config or fp8_decode_config(m, n, k) or Fp8DecodeConfig(64, 128, 0, 4, 4)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bk = block_k if block_k is not None else min(config.block_k, max(32, triton.next_power_of_2(k)))
    k_blocks = triton.cdiv(k, bk)
    n_tiles = triton.cdiv(n, config.block_n)
    split = config.split_k or fit_split_k(n_tiles, k_blocks, num_sms(x.device))
    k_per_split = triton.cdiv(k_blocks, min(split, k_blocks)) * bk
    split = triton.cdiv(k, k_per_split)
    ws, locks = split_k_workspace(x.device, m * n if split > 1 else 1, n_tiles)
    static = input_scale.float().reshape(1) if input_scale is not None else w_scale
    # The per-token amax pass reads [rows, row_cols] tiles of x: <= 64 fp32 per thread.
    rows = triton.next_power_of_2(m)
    row_cols = min(triton.next_power_of_2(k), max(64, 64 * 32 * config.num_warps // rows))
    _fp8_small_m_kernel[(n_tiles, split)](
        x, w_q, w_scale, static, bias if bias is not None else w_scale, out, ws, locks,
        m, n, k, k_per_split, x.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK_SCALES=block_k is not None,
        STATIC_INPUT=input_scale is not None, HAS_BIAS=bias is not None, SPLIT_K=split,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=config.block_n, BLOCK_K=bk,
        NUM_STAGES=config.num_stages, ROWS=rows, ROW_COLS=row_cols, num_warps=config.num_warps,
    )  # fmt: skip
    return out


def _scaled_mm_fits(x: torch.Tensor, w_q: torch.Tensor, block_k: int | None) -> bool:
    """cuBLASLt's row-wise FP8 GEMM takes per-channel scales, bf16 output, K and N % 16 == 0,
    on compute capability 9.0+."""
    return (
        block_k is None
        and x.dtype == torch.bfloat16
        and x.shape[1] % 16 == 0
        and w_q.shape[0] % 16 == 0
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def _decode_config(
    x: torch.Tensor, w_q: torch.Tensor, block_k: int | None
) -> Fp8DecodeConfig | None:
    """The decode kernel's launch for this call, or None for the GEMM paths."""
    m, k = x.shape
    if m > FP8_DECODE_MAX_M:
        return None
    if block_k is not None and (block_k < 32 or block_k > 256 or block_k & (block_k - 1)):
        return None
    config = fp8_decode_config(m, w_q.shape[0], k)
    if config is None and not _scaled_mm_fits(x, w_q, block_k):
        # NOTE: the table's "use _scaled_mm" cannot hold here; the Triton GEMM is slower still.
        return Fp8DecodeConfig(64, 128, 0, 4, 4)
    return config


def fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    block_k: int | None = None,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W^T (+ bias) with W = w_q * w_scale, x quantized to FP8 on the fly.

    x [M, K] (bf16/fp16/fp32); w_q [N, K] float8_e4m3fn; w_scale [N, 1] (per channel) or
    [N, ceil(K / block_k)] (block scales, rows expanded). `input_scale` (a scalar) selects
    static activation scales, else dynamic per token (per token and K-block with block_k)."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be 2-D fp16/bf16/fp32, got {tuple(x.shape)} {x.dtype}")
    if input_scale is not None and block_k is not None:
        raise ValueError("block scales take dynamic activation scales, not an input_scale")
    use_triton = x.is_cuda
    if use_triton:
        config = _decode_config(x, w_q, block_k)
        if config is not None:
            x = x if x.stride(1) == 1 else x.contiguous()
            return fp8_small_m_triton(x, w_q, w_scale, block_k, input_scale, bias, config)
    group = x.shape[1] if block_k is None else block_k
    if input_scale is not None:
        x_q, x_scale = quantize_fp8_static(x, input_scale)
        x_scale = x_scale.contiguous()
    elif use_triton:
        x_q, x_scale = quantize_fp8_triton(x.contiguous(), group)
    else:
        x_q, x_scale = quantize_fp8_reference(x, group)
    if use_triton and _scaled_mm_fits(x, w_q, block_k):
        return torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t(),
            bias=bias.to(x.dtype) if bias is not None else None, out_dtype=x.dtype,
        )  # fmt: skip
    gemm = fp8_gemm_triton if use_triton else fp8_gemm_reference
    if not use_triton:
        _check_gemm(x_q, x_scale, w_q, w_scale, block_k, bias)
    return gemm(x_q, x_scale, w_q, w_scale, block_k, bias, x.dtype)
