"""The C RMSNorm on CPU: the reference's values with and without the residual add, odd widths,
strided rows, rows independent of the batch, inputs left alone."""

from __future__ import annotations

import shutil

import pytest
import torch

from loraplex import envs
from loraplex.kernels import cpu_norm
from loraplex.kernels.layernorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

needs_kernel = pytest.mark.skipif(
    shutil.which(envs.c_compiler()) is None, reason="needs a C compiler"
)


@needs_kernel
@pytest.mark.parametrize("n,d", [(1, 1), (3, 15), (8, 576), (33, 100)])
def test_matches_the_reference(n: int, d: int, lanes: int) -> None:
    gen = torch.Generator().manual_seed(n * d)
    x, res = torch.randn(n, d, generator=gen) * 3, torch.randn(n, d, generator=gen)
    w = torch.randn(d, generator=gen)
    assert cpu_norm.load() is not None and cpu_norm.supports(x, w, res)
    x0, res0 = x.clone(), res.clone()
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(out, ref_out)
    assert torch.equal(new_res, ref_res)
    assert torch.equal(x, x0) and torch.equal(res, res0)


@needs_kernel
def test_strided_rows_and_batch_independence(lanes: int) -> None:
    big = torch.randn(6, 700)
    x, w = big[:, 50:626], torch.randn(576)  # row stride 700
    full = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(full, rms_norm_ref(x, w, 1e-5))
    for i in range(6):
        assert torch.equal(rms_norm(x[i : i + 1], w, 1e-5), full[i : i + 1])
