"""FP8 W8A8 GEMM: the Triton kernels (interpreter on CPU) against the torch reference, per-token
x per-channel and K-block scales, odd sizes."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.fp8_gemm import (
    FP8_DTYPE,
    FP8_MAX,
    FP8_SMALL_M_MAX,
    FP8_TUNED_CONFIGS,
    Fp8DecodeConfig,
    expand_block_scales,
    fp8_decode_config,
    fp8_gemm_reference,
    fp8_gemm_triton,
    fp8_linear,
    fp8_small_m_reference,
    fp8_small_m_triton,
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
    # NOTE: seeded: e4m3 keeps 3 mantissa bits, and the largest of 240 errors against 5% of the
    # largest output fails for some unseeded draws (seen once in a run of two test files).
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 256, generator=gen), torch.randn(40, 256, generator=gen)
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
    # NOTE: equal within one e4m3 step (1/8 relative; 2**-9 among the subnormals): Triton's
    # float32 division is the fast approximate one (within 2 ulp), so a quotient next to a
    # rounding boundary of e4m3 can land on the other side (seen once in 524,288 on the H200).
    torch.testing.assert_close(q_triton.float(), x_q.float(), rtol=0.125, atol=2.0**-9)
    expected = fp8_gemm_reference(x_q, x_scale, w_q, w_scale, block_k, None, torch.bfloat16)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=1e-1)


def _on_grid(m: int, k: int, group: int, seed: int) -> torch.Tensor:
    """x [m, k] whose per-(token, group) quantization is exact: e4m3 values times power-of-two
    scales, one FP8_MAX per group (the CPU interpreter's float8 cast is not round-to-even)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.randn(m, k, generator=gen).clamp(-400, 400).to(FP8_DTYPE).float()
    grid[:, ::group] = FP8_MAX
    return grid * 2.0 ** -torch.randint(1, 8, (m, 1), generator=gen).float()


@pytest.mark.parametrize(
    ("m", "n", "k", "block_k", "split_k"),
    [(1, 40, 72, None, 1), (5, 33, 200, None, 3), (17, 24, 128, 32, 2), (3, 50, 96, 32, 1),
     (32, 16, 64, None, 2)],
)  # fmt: skip
def test_fused_decode_kernel_matches_reference(m, n, k, block_k, split_k) -> None:
    x = _on_grid(m, k, block_k or k, seed=m + n)
    w_q, w_scale = quantize_fp8_reference(torch.randn(n, k), block_k or k)
    bias = torch.randn(n)
    config = Fp8DecodeConfig(32, 32, split_k, 4, 2)
    expected = fp8_small_m_reference(x, w_q, w_scale, block_k, None, bias)
    for _ in range(2):  # the second call finds the split-K workspace zeroed again
        out = fp8_small_m_triton(x, w_q, w_scale, block_k, None, bias, config)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_fused_decode_kernel_takes_a_static_input_scale() -> None:
    x = _on_grid(3, 64, 64, seed=7)
    scale = x.abs().amax() / FP8_MAX
    w_q, w_scale = quantize_fp8_reference(torch.randn(24, 64), 64)
    out = fp8_small_m_triton(x, w_q, w_scale, None, scale.reshape(1), None, None)
    expected = fp8_small_m_reference(x, w_q, w_scale, None, scale.reshape(1), None)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_fused_decode_kernel_rejects_bad_inputs() -> None:
    w_q, w_scale = quantize_fp8_reference(torch.randn(8, 64), 64)
    with pytest.raises(ValueError, match="x must be"):
        fp8_small_m_triton(torch.randn(33, 64), w_q, w_scale, None, None, None)
    with pytest.raises(ValueError, match="block_k a power of two"):
        fp8_small_m_triton(torch.randn(2, 64), w_q, w_scale.expand(8, 4), 16, None, None)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        Fp8DecodeConfig(48, 128, 0, 4, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 3, 16, 32])
@pytest.mark.parametrize("scales", ["channel", "block", "static"])
@pytest.mark.parametrize(
    "config", [Fp8DecodeConfig(128, 128, 0, 4, 4), Fp8DecodeConfig(64, 256, 3, 8, 3)]
)
def test_gpu_fused_decode_kernel_matches_reference(m, scales, config) -> None:
    n, k = 1000, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    block_k = 128 if scales == "block" else None
    w_q, w_scale = quantize_fp8_reference(torch.randn(n, k, device="cuda"), block_k or k)
    static = x.float().abs().amax().reshape(1) / FP8_MAX if scales == "static" else None
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = fp8_small_m_triton(x, w_q, w_scale, block_k, static, bias, config)
    expected = fp8_small_m_reference(x, w_q, w_scale, block_k, static, bias)
    # NOTE: both quantize x identically (round to nearest even) and end in bf16 (2**-8
    # relative); the FP8 MMA adds up to a K tile's products with fewer bits than fp32 (outputs
    # are ~sqrt(K) = 32 here, so an absolute 0.1 is ~3e-3 of a typical one).
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0.1)


def test_decode_config_follows_the_measured_table() -> None:
    # A tuned shape takes its measured winner, or None where _scaled_mm measured faster.
    assert fp8_decode_config(1, 28672, 4096) == FP8_TUNED_CONFIGS[(1, 28672, 4096)]
    assert FP8_TUNED_CONFIGS[(32, 4096, 4096)] is None
    assert fp8_decode_config(20, 4096, 4096) is None
    # An untuned shape runs the decode kernel up to FP8_SMALL_M_MAX tokens, never above 32.
    assert isinstance(fp8_decode_config(FP8_SMALL_M_MAX, 1000, 512), Fp8DecodeConfig)
    assert fp8_decode_config(FP8_SMALL_M_MAX + 1, 1000, 512) is None
    assert fp8_decode_config(33, 28672, 4096) is None
