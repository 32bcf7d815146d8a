"""The W4A16 launches `benchmarks.quant_gemm` sweeps per (M, N, K), and their compilation ahead
of the sweep in parallel processes (Triton's disk cache then serves the timing process).

Per token count: the fused kernel's tile shapes worth timing (token tile = the MMA's N side,
weight rows = its M side, warps, pipeline stages), each with the split-K that gives about 1, 2
or 4 programs per SM; from 128 tokens on also the scaled-operand form and dequant + cuBLAS.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import astuple, replace

from loraplex.kernels.split_k import fit_split_k
from loraplex.kernels.w4a16.types import TILE_K, W4A16Config

#: (kind, block_m, block_n, num_warps, num_stages, prefetch) per M range. The launches without
#: prefetch are those of the a8e4623 sweep; each winner of that sweep is tried with its scales
#: and zero points loaded a tile ahead too (ncu: the long-scoreboard stall led at M = 1 and
#: 128), and two deeper, narrower decode pipelines that need less split-K.
_DECODE = [("mma", 16, 64, 4, 4, False), ("mma", 16, 128, 4, 3, False),
           ("mma", 16, 128, 4, 4, False), ("mma", 16, 256, 8, 3, False),
           ("mma", 16, 64, 2, 4, False), ("mma", 16, 128, 4, 3, True), ("mma", 16, 64, 2, 4, True),
           ("mma", 16, 64, 2, 6, True), ("mma", 16, 32, 1, 8, True)]  # fmt: skip
_MID = [("mma", 64, 64, 4, 4, False), ("mma", 64, 128, 4, 3, False),
        ("mma", 64, 256, 8, 3, False), ("mma_wscale", 64, 128, 4, 3, False),
        ("mma", 64, 256, 8, 3, True), ("mma", 64, 128, 4, 3, True)]  # fmt: skip
_LARGE = [("mma_wscale", 128, 128, 8, 3, False), ("mma", 128, 128, 8, 3, False),
          ("mma_wscale", 128, 64, 4, 3, False), ("mma_wscale", 64, 128, 4, 3, False),
          ("mma_wscale", 128, 256, 8, 3, False), ("mma_wscale", 128, 128, 8, 3, True),
          ("mma_wscale", 128, 64, 4, 3, True)]  # fmt: skip
_PREFILL = [("mma_wscale", 256, 128, 8, 3, False), ("mma_wscale", 128, 256, 8, 3, False),
            ("mma_wscale", 128, 128, 8, 4, False), ("mma_wscale", 256, 128, 8, 3, True)]  # fmt: skip
_DEQUANT = [W4A16Config("dequant", 16, 64, 1, 4, 1), W4A16Config("dequant", 16, 128, 1, 8, 1)]


def _tiles_and_splits(m: int) -> tuple[list[tuple], tuple[float, ...]]:
    """Tile shapes and programs per SM (0: no split) at M tokens. NOTE: split-K partials are
    M x N fp32 atomics each, so the more tokens, the fewer splits are worth trying."""
    if m <= 16:
        return _DECODE, (1, 2, 4)
    if m <= 64:
        return _MID, (0.45, 0.9, 2)
    if m <= 128:
        return _LARGE, (0.45, 0.9)
    if m <= 256:
        return [_LARGE[0], *_PREFILL], (0, 0.9)
    return _PREFILL, (0,)


def w4a16_candidates(m: int, n: int, k: int, sms: int) -> list[W4A16Config]:
    """The launches timed at M tokens of an [N, K] weight, split-K made explicit."""
    tiles, per_sm = _tiles_and_splits(m)
    k_tiles = -(-k // TILE_K)
    configs: list[W4A16Config] = []
    for kind, block_m, block_n, warps, stages, ahead in tiles:
        output_tiles = -(-m // block_m) * -(-n // block_n)
        splits = sorted({fit_split_k(output_tiles, k_tiles, sms, p) if p else 1 for p in per_sm})
        configs += [W4A16Config(kind, block_m, block_n, s, warps, stages, ahead) for s in splits]
    if m >= 128:
        configs += _DEQUANT
    return list(dict.fromkeys(configs))


def compile_keys(configs: list[W4A16Config]) -> list[W4A16Config]:
    """One config per compiled kernel (split-K is a run-time argument)."""
    return list(dict.fromkeys(replace(c, split_k=1) for c in configs))


def _compile(fields: tuple) -> str:
    """Compile one launch by running it once at a small shape with the real shapes'
    specialization (bf16, 4-bit g128, every size and stride divisible by 16)."""
    import torch

    from loraplex.kernels.w4a16 import w4a16_gemm_triton

    config = W4A16Config(*fields)
    n, k = 512, 1024
    qweight = torch.zeros(n, k // 8, dtype=torch.int32, device="cuda")
    scales = torch.ones(k // 128, n, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros(2, k, dtype=torch.bfloat16, device="cuda")
    try:
        for split in (1, 2):
            w4a16_gemm_triton(
                x, qweight, scales, scales, 128, 4, config=replace(config, split_k=split)
            )
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported; the sweep's check then skips it
        return f"{config}: {type(exc).__name__}: {exc}"[:300]
    return ""


def precompile(configs: list[W4A16Config], workers: int) -> list[str]:
    """Compile every config's kernel in `workers` processes; the failures, as text."""
    keys = [astuple(c) for c in compile_keys(configs)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return [error for error in pool.map(_compile, keys) if error]
