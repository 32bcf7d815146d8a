"""The C row argmax against torch's `argmax(dim=-1)`: odd row lengths, ties (the first maximum
wins), NaN rows (the first NaN), infinities, strided rows, and the sampler's greedy tokens."""

from __future__ import annotations

import shutil

import pytest
import torch

from loraplex import envs
from loraplex.kernels.sampling import greedy_tokens
from loraplex.kernels.sampling.cpu_argmax import argmax_rows, load

needs_kernel = pytest.mark.skipif(
    shutil.which(envs.c_compiler()) is None, reason="needs a C compiler"
)


@needs_kernel
@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (2, 16), (5, 17), (4, 49152), (9, 1000)])
def test_matches_torch(rows: int, n: int, lanes: int) -> None:
    assert load() is not None
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * n))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@needs_kernel
def test_ties_nans_and_infinities_follow_torch(lanes: int) -> None:
    x = torch.zeros(6, 40)
    x[0, [5, 21, 39]] = 3.0  # equal maxima: the first
    x[1, 33] = float("nan")  # a NaN wins
    x[1, 2] = float("inf")
    x[2, [3, 30]] = float("nan")  # the first NaN
    x[3] = float("-inf")  # nothing but -inf: index 0
    x[4, 17] = float("inf")
    x[5, 0] = float("nan")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [5, 33, 3, 0, 17, 0]


@needs_kernel
def test_strided_rows_and_greedy_tokens() -> None:
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(1))[:, :250]
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
    assert torch.equal(greedy_tokens(x.double()), x.double().argmax(dim=-1))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="fp32"):
        argmax_rows(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        argmax_rows(torch.zeros(4))
