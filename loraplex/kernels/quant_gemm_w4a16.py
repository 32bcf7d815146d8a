"""W4A16 / W8A16 dequant-GEMM: y = x @ dequant(W) for AWQ and GPTQ weights.

The kernels take one weight layout, to which AWQ and GPTQ checkpoints are repacked at load:
- `qweight` [K / pack, N] int32, 32 // bits values per word packed along K in plain order
  (value i of a word at bits [i * bits, (i + 1) * bits)), the GPTQ layout;
- `scales` [G, N] and `zeros` [G, N] (zero points as floats) with G = K / group_size;
  weight[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n];
- `perm` [K] int32 or None: act-order. Row k of the packed weight multiplies input feature
  perm[k]; the load sorted the rows by group so groups are contiguous again.

On CUDA `wna16_gemm` asks `quant_gemm_configs.select_config` (the one place that dispatches on
the token count M) for a kernel: "gemv" or "fma" (FMA, split-K) for decode, "gemm", "gemm_t",
"sliced", "sliced_t", "stream" or "stream_pair" (tiled tensor-core, split-K when the tiles do not fill the GPU) for mid
and large sizes (dequantization inside the main loop, no bf16 copy of the weight), "dequant"
(chunked dequantization into an L2-resident buffer + dense matmul) for prefill. The kernels are
in `triton_quant_gemm`, `triton_quant_gemm_small_m`, `triton_quant_gemm_sliced` and
`triton_quant_gemm_stream`.
"""

from __future__ import annotations

import torch
import triton

from loraplex.kernels.quant_gemm_configs import (
    DEQUANT_MATMUL_MIN_M,
    ONE_ROW_KINDS,
    SLICED_KINDS,
    GemmConfig,
    resolve,
    select_config,
    without_shallow_slices,
)
from loraplex.kernels.quant_gemm_workspace import dequant_buffer, split_k_workspace
from loraplex.kernels.triton_quant_gemm import (
    _wna16_dequant_kernel,
    _wna16_gemm_kernel,
    _wna16_gemv_kernel,
)
from loraplex.kernels.triton_quant_gemm_sliced import _wna16_sliced_kernel
from loraplex.kernels.triton_quant_gemm_small_m import _wna16_fma_kernel, _wna16_gemm_t_kernel
from loraplex.kernels.triton_quant_gemm_stream import _wna16_stream_kernel

__all__ = [
    "DEQUANT_MATMUL_MIN_M",
    "GemmConfig",
    "kernel_name",
    "select_config",
    "wna16_dequantize",
    "wna16_dequantize_reference",
    "wna16_gemm",
    "wna16_gemm_reference",
    "wna16_gemm_triton",
]

_DEQUANT_BLOCK_N = 128


def wna16_dequantize_reference(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch dequantization: the weight [K, N] in fp32, rows in input-feature order."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # [K / pack, pack, N]
    groups, n = scales.shape
    q = q.reshape(groups, -1, n).float()  # [G, group_size, N]
    w = (q - zeros.float().unsqueeze(1)) * scales.float().unsqueeze(1)
    w = w.reshape(-1, n)  # [K, N]
    if perm is None:
        return w
    return torch.empty_like(w).index_copy_(0, perm.long(), w)


def wna16_gemm_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch y = x @ dequant(W) (+ bias), computed in fp32, returned in x's dtype."""
    w = wna16_dequantize_reference(qweight, scales, zeros, group_size, bits, perm)
    y = x.float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


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
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be 2-D fp16/bf16/fp32, got {tuple(x.shape)} {x.dtype}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D int32, got {tuple(qweight.shape)} {qweight.dtype}")
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} input features, the weight {k}")
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide K={k}")
    groups = k // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (groups, n) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be float [{groups}, {n}], got {tuple(t.shape)}")
    if perm is not None and (perm.dtype != torch.int32 or tuple(perm.shape) != (k,)):
        raise ValueError(f"perm must be int32 [{k}], got {tuple(perm.shape)} {perm.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if any(t.stride(-1) != 1 for t in (qweight, scales, zeros)):
        raise ValueError("qweight, scales and zeros must be contiguous along N")
    tensors = [t for t in (x, qweight, scales, zeros, perm, bias) if t is not None]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x and the weight tensors must be on one device")


def _launch_dequant(qweight, scales, zeros, perm, out, group_size, bits, block_k, warps) -> None:
    k, n = out.shape
    grid = (k // block_k, triton.cdiv(n, _DEQUANT_BLOCK_N))
    _wna16_dequant_kernel[grid](
        qweight, scales, zeros, perm if perm is not None else qweight, out,
        n, group_size, qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, HAS_PERM=perm is not None, BLOCK_K=block_k, BLOCK_N=_DEQUANT_BLOCK_N,
        num_warps=warps,
    )  # fmt: skip


def wna16_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Triton dequantization to a dense weight [K, N] of `dtype`, rows in input order."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    config = resolve(GemmConfig("dequant", 0, 0, 128, 1, 4, 1), 0, n, k, group_size, bits, 1)
    _launch_dequant(qweight, scales, zeros, perm, out, group_size, bits, config.block_k, 4)
    return out


def _dequant_matmul(x, qweight, scales, zeros, group_size, bits, perm, bias, config):
    """Dequantize `config.block_n` columns at a time into one reused buffer and matmul each."""
    k, n = x.shape[1], qweight.shape[1]
    chunk = min(config.block_n or n, n)
    buf = dequant_buffer(x.device, k * chunk, x.dtype)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for n0 in range(0, n, chunk):
        cols = slice(n0, min(n0 + chunk, n))
        w = buf[: k * (cols.stop - n0)].view(k, -1)  # [K, chunk]
        _launch_dequant(
            qweight[:, cols], scales[:, cols], zeros[:, cols], perm, w,
            group_size, bits, config.block_k, config.num_warps,
        )  # fmt: skip
        if chunk == n:
            return x @ w if bias is None else torch.addmm(bias, x, w)
        if bias is None:
            torch.mm(x, w, out=out[:, cols])
        else:
            torch.addmm(bias[cols], x, w, out=out[:, cols])
    return out


def _magic(dtype: torch.dtype, bits: int) -> tuple[int, float]:
    """16-bit pattern whose low mantissa bits take an integer value, and the value it adds."""
    if dtype == torch.float16:
        return 0x6400, 1024.0
    if dtype == torch.bfloat16 and bits == 4:
        return 0x4300, 128.0
    return 0, 0.0


def wna16_gemm_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    bits: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The Triton path: x [M, K] -> [M, N] in x's dtype, with `config` or the selected one."""
    _check_inputs(x, qweight, scales, zeros, group_size, bits, perm, bias)
    m, n, k = x.shape[0], qweight.shape[1], x.shape[1]
    sms = _num_sms(x.device)
    if config is None:
        config = select_config(m, n, k, group_size, bits, sms)
    else:
        config = resolve(config, m, n, k, group_size, bits, sms)
    if x.is_cuda:
        config = without_shallow_slices(config, bits)
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    if config.kind == "dequant":
        return _dequant_matmul(x, qweight, scales, zeros, group_size, bits, perm, bias, config)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(k // config.block_k, config.split_k) * config.block_k
    split = triton.cdiv(k, k_per_split)
    n_tiles = triton.cdiv(n, config.block_n)
    rows = m if config.kind in ONE_ROW_KINDS else triton.cdiv(m, config.block_m)
    ws, locks = split_k_workspace(x.device, m * n if split > 1 else 1, rows * n_tiles)
    common = (
        x, qweight, scales, zeros, perm if perm is not None else qweight,
        bias if bias is not None else scales, out, ws, locks,
    )  # fmt: skip
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0))
    flags = dict(BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SPLIT_K=split)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    tiles = dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k)
    if config.kind == "gemv":
        _wna16_gemv_kernel[(n_tiles, split, m)](
            *common, n, group_size, k_per_split, *strides, **flags, **tiles, **launch,
        )  # fmt: skip
        return out
    if config.kind == "fma":
        _wna16_fma_kernel[(m * n_tiles, split)](
            *common, m, n, group_size, k_per_split, *strides, **flags, **tiles,
            NUM_STAGES=config.num_stages, **launch,
        )  # fmt: skip
        return out
    magic, offset = _magic(x.dtype, bits)
    mma = dict(
        MAGIC=magic, OFFSET=offset, BLOCK_M=config.block_m,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if config.kind in ("stream", "stream_pair"):
        _wna16_stream_kernel[(rows * n_tiles, split)](
            *common, m, n, group_size, k_per_split, *strides, **flags, **mma, **tiles,
            NUM_STAGES=config.num_stages, JOIN_PAIRS=config.kind == "stream_pair", **launch,
        )  # fmt: skip
        return out
    if config.kind in SLICED_KINDS:
        _wna16_sliced_kernel[(rows * n_tiles, split)](
            *common, m, n, group_size, k_per_split, *strides, **flags, **mma, **tiles,
            SWAP=config.kind == "sliced_t", NUM_STAGES=config.num_stages, **launch,
        )  # fmt: skip
        return out
    if config.kind == "gemm_t":
        _wna16_gemm_t_kernel[(rows * n_tiles, split)](
            *common, m, n, group_size, k_per_split, *strides, **flags, **mma, **tiles,
            NUM_STAGES=config.num_stages, **launch,
        )  # fmt: skip
        return out
    _wna16_gemm_kernel[(rows * n_tiles, split)](
        *common, m, n, group_size, k_per_split, *strides, **flags, **mma, **tiles, **launch,
    )  # fmt: skip
    return out


def wna16_gemm(
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

    On CUDA runs the kernel `select_config` picks for M; elsewhere the torch reference."""
    _check_inputs(x, qweight, scales, zeros, group_size, bits, perm, bias)
    if not x.is_cuda:
        return wna16_gemm_reference(x, qweight, scales, zeros, group_size, bits, perm, bias)
    return wna16_gemm_triton(x, qweight, scales, zeros, group_size, bits, perm, bias)


def kernel_name(m: int, n: int, k: int, group_size: int, bits: int) -> str:
    """Which kernel and tiles `wna16_gemm` runs on CUDA for M tokens (for logs, benchmarks)."""
    c = select_config(m, n, k, group_size, bits, _num_sms(torch.device("cuda")))
    if c.kind == "dequant":
        return f"dequant(chunk {c.block_n or n}, bk {c.block_k})+matmul"
    return f"{c.kind}({c.block_m}x{c.block_n}x{c.block_k}, split {c.split_k}, w{c.num_warps})"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
