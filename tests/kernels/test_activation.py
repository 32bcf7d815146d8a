"""SiLU-and-mul: the Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("shape", [(1, 2), (7, 6), (5, 2 * 1100), (2, 3, 2 * 35)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from loraplex.kernels.triton_activation import silu_and_mul_triton

    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype) * 3
    out = silu_and_mul_triton(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x.float()), atol=2e-2, rtol=1e-2)


def test_wrapper_rejects_odd_width() -> None:
    from loraplex.kernels.triton_activation import silu_and_mul_triton

    with pytest.raises(ValueError, match="2 \\* intermediate"):
        silu_and_mul_triton(torch.randn(3, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_at_real_sizes() -> None:
    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    out = silu_and_mul(x)
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x.float()), atol=2e-2, rtol=1e-2)
