"""W4A16 / W8A16 dequant-GEMM: the Triton kernels (interpreter on CPU) against the torch
reference, on random weights of odd sizes, both bit widths, act-order and split-K."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.quant_gemm_w4a16 import (
    GemmConfig,
    select_config,
    wna16_dequantize,
    wna16_dequantize_reference,
    wna16_gemm,
    wna16_gemm_reference,
    wna16_gemm_triton,
)


def _weights(bits: int, n: int, k: int, group_size: int, act_order: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pack = 32 // bits
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // pack, n), generator=gen, dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).half()
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    return qweight, scales, zeros, perm


@pytest.mark.parametrize(
    ("bits", "m", "n", "k", "group_size", "act_order", "split_k"),
    [(4, 1, 40, 64, 32, False, 1), (4, 5, 24, 128, 64, True, 2), (8, 17, 56, 96, 96, False, 1),
     (8, 3, 8, 64, 16, True, 4), (4, 33, 72, 32, 32, False, 1)],
)  # fmt: skip
def test_fused_kernel_matches_reference(bits, m, n, k, group_size, act_order, split_k) -> None:
    qweight, scales, zeros, perm = _weights(bits, n, k, group_size, act_order)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    config = GemmConfig(16, 32, min(32, group_size), split_k, 4, 1)
    out = wna16_gemm_triton(x, qweight, scales, zeros, group_size, bits, perm, bias, config)
    expected = wna16_gemm_reference(x, qweight, scales, zeros, group_size, bits, perm, bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("bits", "act_order"), [(4, True), (8, False)])
def test_dequant_kernel_matches_reference(bits: int, act_order: bool) -> None:
    qweight, scales, zeros, perm = _weights(bits, 48, 64, 32, act_order, seed=1)
    out = wna16_dequantize(qweight, scales, zeros, 32, bits, perm, torch.float32)
    torch.testing.assert_close(
        out, wna16_dequantize_reference(qweight, scales, zeros, 32, bits, perm)
    )


def test_reference_dequantizes_the_documented_layout() -> None:
    # word 0 of column 0 holds values 0..7 for rows 0..7 (value i at bits 4i)
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32)
    w = wna16_dequantize_reference(qweight, torch.ones(1, 1), torch.full((1, 1), 2.0), 8, 4)
    assert w[:, 0].tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_split_k_fills_the_gpu_only_for_few_tokens() -> None:
    assert select_config(1, 4096, 4096, 128, 132).split_k > 1
    assert select_config(1, 28672, 4096, 128, 132).split_k == 1
    assert select_config(512, 4096, 4096, 128, 132).split_k == 1
    assert select_config(1, 4096, 4096, 32, 132).block_k == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [({"bits": 3}, "bits must be 4 or 8"), ({"group_size": 48}, "group_size 48 must divide"),
     ({"x": torch.randn(2, 32)}, "x has 32 input features"),
     ({"scales": torch.ones(1, 16)}, r"scales must be float \[2, 16\]"),
     ({"perm": torch.arange(64)}, "perm must be int32")],
)  # fmt: skip
def test_wrapper_rejects_bad_inputs(change: dict, message: str) -> None:
    qweight, scales, zeros, _ = _weights(4, 16, 64, 32, False)
    args = {"x": torch.randn(2, 64), "qweight": qweight, "scales": scales, "zeros": zeros,
            "group_size": 32, "bits": 4, "perm": None} | change  # fmt: skip
    with pytest.raises(ValueError, match=message):
        wna16_gemm(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64, 300, 1024])
@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, False)])
def test_gpu_dispatch_matches_reference(m: int, bits: int, act_order: bool) -> None:
    qweight, scales, zeros, perm = _weights(bits, 1000, 512, 128, act_order)
    args = [t.cuda() if t is not None else None for t in (qweight, scales, zeros, perm)]
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    out = wna16_gemm(x, args[0], args[1], args[2], 128, bits, args[3])
    expected = wna16_gemm_reference(x, args[0], args[1], args[2], 128, bits, args[3])
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-1)
