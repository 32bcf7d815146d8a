"""The C paged attention on CPU against dense attention: decode, short and long prefills mixed
with decode, GQA, odd head sizes, rows independent of the batch, and refused block ids."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

from loraplex import envs
from loraplex.kernels import cpu_attention
from loraplex.kernels.attention import paged_attention
from tests.kernels.test_attention import dense_attention, make_batch

needs_kernel = pytest.mark.skipif(
    shutil.which(envs.c_compiler()) is None, reason="needs a C compiler"
)


def _run(batch, max_query_len: int) -> torch.Tensor:
    return paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.scale, max_query_len=max_query_len,
        max_seq_len=int(batch.seq_lens.max()),
    )  # fmt: skip


@needs_kernel
@pytest.mark.parametrize(
    "shapes,heads,kv_heads,head_dim",
    [
        ([(1, 1), (1, 17), (1, 64), (1, 33)], 9, 3, 64),  # decode, GQA
        ([(1, 40), (5, 5), (3, 20), (1, 2)], 4, 4, 72),  # mixed, no GQA, head_dim not 16k
        ([(1, 30), (70, 90), (2, 9)], 6, 2, 40),  # a query past MAX_QUERY_LEN: SDPA's rows
    ],
)
def test_matches_dense_attention(
    shapes, heads: int, kv_heads: int, head_dim: int, lanes: int
) -> None:
    batch = make_batch(shapes, heads, kv_heads, head_dim, dtype=torch.float32, fill=float("nan"))
    assert cpu_attention.load() is not None
    out = _run(batch, max(q for q, _ in shapes))
    torch.testing.assert_close(out, dense_attention(batch), atol=2e-5, rtol=1e-4)


@needs_kernel
def test_a_row_is_the_same_whatever_shares_the_batch(lanes: int) -> None:
    batch = make_batch([(1, 50), (1, 7), (1, 33)], 8, 2, 64, dtype=torch.float32)
    full = _run(batch, 1)
    for i in range(3):
        rows = slice(i, i + 1)
        one = replace(batch, q=batch.q[rows], query_start_loc=batch.query_start_loc[:2],
                      seq_lens=batch.seq_lens[rows], block_tables=batch.block_tables[rows])  # fmt: skip
        assert torch.equal(_run(one, 1), full[i : i + 1])


@needs_kernel
def test_a_block_id_out_of_range_is_refused() -> None:
    batch = make_batch([(1, 20)], 2, 2, 16, dtype=torch.float32)
    batch.block_tables[0, 0] = batch.k_cache.shape[0]
    with pytest.raises(IndexError):
        _run(batch, 1)
