"""RMSNorm and fused add + RMSNorm: the Triton kernels against the torch references."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.layernorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

SHAPES = [(1, 64), (7, 100), (3, 5, 576)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu"):
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=gen).to(dtype).to(device)
    residual = torch.randn(shape, generator=gen).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from loraplex.kernels.triton_norm import rms_norm_triton

    x, _, weight = _inputs(shape, dtype)
    out = rms_norm_triton(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from loraplex.kernels.triton_norm import fused_add_rms_norm_triton

    x, residual, weight = _inputs(shape, dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    # NOTE: the CPU interpreter truncates fp32 -> bf16 where the GPU rounds: one bf16 ulp apart.
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=2**-7)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=1e-2)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Off CUDA the wrappers run torch's fused RMSNorm: the reference's values (fp32 math),
    inputs untouched."""
    x, residual, weight = _inputs(shape, dtype)
    x_before, residual_before = x.clone(), residual.clone()
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-7}
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), **tol)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **tol)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_wrapper_rejects_wrong_weight() -> None:
    from loraplex.kernels.triton_norm import rms_norm_triton

    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(torch.randn(2, 8), torch.ones(7), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_at_real_sizes() -> None:
    x, residual, weight = _inputs((4096, 4096), torch.bfloat16, "cuda")
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), atol=2e-2, rtol=1e-2
    )
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=1e-2)
