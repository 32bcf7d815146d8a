"""One-token GEMV: the Triton kernel against F.linear, and the dispatch that picks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import gemv
from loraplex.kernels.gemv import GemvConfig

SMALL = GemvConfig(block_n=4, block_k=16, num_warps=1, num_stages=1)


@pytest.mark.parametrize(
    ("m", "n", "k", "bias"), [(1, 8, 32, False), (1, 13, 40, True), (2, 6, 16, False)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_linear(m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    # Odd n and k cover the row and column masks; m = 2 reads the weight once per row.
    from loraplex.kernels.triton_gemv import gemv_triton

    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = gemv_triton(x, w, b, SMALL)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float(), ref, atol=3e-2 if dtype == torch.bfloat16 else 1e-4,
                               rtol=1e-2)  # fmt: skip


def test_strided_rows_of_x_and_weight() -> None:
    from loraplex.kernels.triton_gemv import gemv_triton

    x = torch.randn(1, 64)[:, :32]  # row stride 64
    w = torch.randn(8, 48)[:, :32]
    torch.testing.assert_close(gemv_triton(x, w, None, SMALL), F.linear(x, w), atol=1e-4, rtol=0)


def test_wrapper_rejects_bad_inputs() -> None:
    from loraplex.kernels.triton_gemv import gemv_triton

    with pytest.raises(ValueError, match="disagree"):
        gemv_triton(torch.randn(1, 8), torch.randn(4, 9), None, SMALL)
    with pytest.raises(ValueError, match="dtype|is torch"):
        gemv_triton(torch.randn(1, 8), torch.randn(4, 8).bfloat16(), None, SMALL)
    with pytest.raises(ValueError, match="bias"):
        gemv_triton(torch.randn(1, 8), torch.randn(4, 8), torch.randn(5), SMALL)
    with pytest.raises(ValueError, match="contiguous last"):
        gemv_triton(torch.randn(1, 8), torch.randn(8, 4).t(), None, SMALL)


def test_dispatch_keeps_f_linear_off_cuda_and_for_batches(monkeypatch) -> None:
    import loraplex.kernels.triton_gemv as triton_gemv

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton GEMV ran where F.linear should")

    monkeypatch.setattr(triton_gemv, "gemv_triton", refuse)
    monkeypatch.setitem(gemv.GEMV_CONFIGS, (8, 16), SMALL)
    w = torch.randn(8, 16)
    for x in (torch.randn(1, 16), torch.randn(3, 16)):  # a tuned shape, but on CPU
        torch.testing.assert_close(gemv.linear(x, w, None), F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (4096, 14336), (1000, 4100)])
def test_on_gpu_at_real_sizes(n: int, k: int) -> None:
    from loraplex.kernels.triton_gemv import gemv_triton

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    for config in [GemvConfig(8, 512, 4, 3), *gemv.GEMV_CONFIGS.values()]:
        out = gemv_triton(x, w, None, config)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=2e-2,
                                   rtol=2e-2)  # fmt: skip
