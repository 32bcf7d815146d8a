"""Dense projections: a Triton GEMV for one token where it measured faster than cuBLAS, on CPU
oneDNN on a packed weight for fp32 (`cpu_linear`), else `F.linear`. Batch-1 decode is a pure
weight read, and cuBLAS streams the smaller projections of an 8B model at about 3.0 TB/s of the
H200's ~4.2 (benchmarks/results/h200_decode_profile.json).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_linear


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output rows per program
    block_k: int  # weight columns per loop step
    num_warps: int
    num_stages: int


#: (out_features, in_features) -> the config `python -m benchmarks.gemv` found fastest on the
#: H200, for the shapes where it beat cuBLAS; other shapes use F.linear.
GEMV_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    # Llama-3.1-8B (h200_gemv.json): qkv, o, gate-up, down, lm_head
    (6144, 4096): GemvConfig(16, 512, 8, 4),
    (4096, 4096): GemvConfig(8, 512, 4, 2),
    (28672, 4096): GemvConfig(8, 512, 4, 4),
    (4096, 14336): GemvConfig(16, 1024, 8, 2),
    (128256, 4096): GemvConfig(16, 256, 4, 4),
}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias): the tuned Triton GEMV when M == 1 on CUDA, oneDNN
    on a packed weight (`cpu_linear`) for fp32 on CPU."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype:
        config = GEMV_CONFIGS.get((weight.shape[0], weight.shape[1]))
        if (
            config is not None
            and x.stride(1) == 1
            and weight.stride(1) == 1
            and (bias is None or bias.is_contiguous())
        ):
            from loraplex.kernels.triton_gemv import gemv_triton

            return gemv_triton(x, weight, bias, config)
    if cpu_linear.wanted(x, weight, bias):
        return cpu_linear.linear_cpu(x, weight, bias)
    return F.linear(x, weight, bias)
