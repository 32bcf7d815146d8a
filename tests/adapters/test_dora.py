"""DoRA's column scale, computed without forming `W + s·BA`, equals PEFT's definition."""

from __future__ import annotations

import pytest
import torch

from loraplex.adapters.dora import dora_column_scale, row_sq_norms


@pytest.mark.parametrize(("out", "inp", "rank", "scaling"), [(7, 5, 1, 2.0), (33, 64, 8, 0.25)])
def test_scale_is_magnitude_over_the_adapted_rows_norm(out, inp, rank, scaling):
    gen = torch.Generator().manual_seed(out)
    w = torch.randn(out, inp, generator=gen, dtype=torch.float64)
    a = torch.randn(rank, inp, generator=gen, dtype=torch.float64)
    b = torch.randn(out, rank, generator=gen, dtype=torch.float64)
    m = torch.rand(out, generator=gen, dtype=torch.float64) + 0.5
    expected = m / torch.linalg.norm(w + scaling * b @ a, dim=1)  # PEFT's get_weight_norm
    got = dora_column_scale(row_sq_norms(w, chunk_rows=4), a @ w.T, a, b, scaling, m)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
