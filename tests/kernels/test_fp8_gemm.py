"""FP8 W8A8 GEMM: the Triton kernels (interpreter on CPU) against the torch reference, per-token
x per-channel and K-block scales, odd sizes."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.fp8_gemm import (
    FP8_DTYPE,
    FP8_MAX,
    expand_block_scales,
    fp8_gemm_reference,
    fp8_gemm_triton,
    fp8_linear,
    quantize_fp8_reference,
    quantize_fp8_triton,
)


@pytest.mark.parametrize(
    ("m", "n", "k", "block_k"),
    [(3, 40, 72, None), (17, 33, 200, 64), (5, 16, 48, 32), (1, 24, 128, 128)],
)
def test_fp8_gemm_matches_reference(m: int, n: int, k: int, block_k: int | None) -> None:
    group = k if block_k is None else block_k
    x_q, x_scale = quantize_fp8_reference(torch.randn(m, k), group)
    w_q, w_scale = quantize_fp8_reference(torch.randn(n, k), group)
    bias = torch.randn(n)
    out = fp8_gemm_triton(x_q, x_scale, w_q, w_scale, block_k, bias, torch.float32)
    expected = fp8_gemm_reference(x_q, x_scale, w_q, w_scale, block_k, bias, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("m", "k", "group"), [(3, 72, 72), (4, 200, 64)])
def test_activation_quant_kernel_matches_reference(m: int, k: int, group: int) -> None:
    # NOTE: inputs lie on the e4m3 grid times a per-group scale, so the kernel's cast is exact:
    # the CPU interpreter's own float8 rounding is not IEEE round-to-nearest-even.
    grid = torch.randn(m, k).clamp(-400, 400).to(FP8_DTYPE).float()
    grid[:, ::group] = FP8_MAX  # one element at the top of each group fixes its scale
    x = grid * 2.0 ** -torch.randint(1, 8, (m, 1)).float()  # power-of-two scales divide exactly
    q, scales = quantize_fp8_triton(x, group)
    q_ref, scales_ref = quantize_fp8_reference(x, group)
    torch.testing.assert_close(scales, scales_ref)
    torch.testing.assert_close(q.float(), q_ref.float())


def test_fp8_linear_is_close_to_the_dense_product() -> None:
    x, w = torch.randn(6, 256), torch.randn(40, 256)
    w_q, w_scale = quantize_fp8_reference(w, 128)
    y = fp8_linear(x, w_q, w_scale, block_k=128)
    assert (y - x @ w.t()).abs().max() < 0.05 * (x @ w.t()).abs().max()


def test_block_scales_expand_to_rows() -> None:
    rows = expand_block_scales(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 130, 128)
    assert rows.shape == (130, 2) and rows[127].tolist() == [1.0, 2.0] and rows[129, 1] == 4.0


def test_gemm_rejects_bad_inputs() -> None:
    x_q, x_scale = quantize_fp8_reference(torch.randn(2, 64), 64)
    w_q, w_scale = quantize_fp8_reference(torch.randn(8, 64), 64)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        fp8_gemm_triton(x_q.float(), x_scale, w_q, w_scale, None, None, torch.float32)
    with pytest.raises(ValueError, match=r"scales must be \[2, 2\] and \[8, 2\]"):
        fp8_gemm_triton(x_q, x_scale, w_q, w_scale, 32, None, torch.float32)
    with pytest.raises(ValueError, match="block scales take dynamic"):
        fp8_linear(torch.randn(2, 64), w_q, w_scale, block_k=64, input_scale=torch.ones(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 64, 1024])
@pytest.mark.parametrize("block_k", [None, 128])
def test_gpu_fp8_linear_matches_reference(m: int, block_k: int | None) -> None:
    x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
    w_q, w_scale = quantize_fp8_reference(torch.randn(1000, 512, device="cuda"), block_k or 512)
    out = fp8_linear(x, w_q, w_scale, block_k=block_k)
    x_q, x_scale = quantize_fp8_reference(x, block_k or 512)
    q_triton, s_triton = quantize_fp8_triton(x, block_k or 512)
    torch.testing.assert_close(s_triton, x_scale)
    torch.testing.assert_close(q_triton.float(), x_q.float())
    expected = fp8_gemm_reference(x_q, x_scale, w_q, w_scale, block_k, None, torch.bfloat16)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=1e-1)
