"""Paged attention: the torch reference against dense attention, the Triton kernel against both."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loraplex.kernels.attention import decode_plan, paged_attention, paged_attention_ref

BLOCK_SIZE = 16


@dataclass(frozen=True)
class PagedBatch:
    """A random batch laid out as the runner lays it out, plus its dense per-sequence K/V."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]
    scale: float


def make_batch(
    shapes: list[tuple[int, int]],  # (query_len, seq_len) per sequence
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    fill: float = 0.0,
    seed: int = 0,
) -> PagedBatch:
    """Scatters each sequence's K/V over shuffled cache blocks; unused slots hold `fill`."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for _, seq_len in shapes]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    tables = torch.zeros(len(shapes), max(blocks_per_seq) + 2, dtype=torch.int32)
    dense_k, dense_v, queries = [], [], []
    used = 0
    for i, (query_len, seq_len) in enumerate(shapes):
        blocks = order[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        tables[i, : len(blocks)] = blocks.int()
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        k_cache[blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k
        v_cache[blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v
        dense_k.append(k.to(device))
        dense_v.append(v.to(device))
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
    starts = torch.tensor([0] + [q for q, _ in shapes], dtype=torch.int32).cumsum(0).int()
    return PagedBatch(
        q=torch.cat(queries).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        dense_k=dense_k,
        dense_v=dense_v,
        scale=head_dim**-0.5,
    )


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Naive causal attention per sequence in fp32, K/V expanded to every query head."""
    outs = []
    starts = batch.query_start_loc.tolist()
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    for i, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v)):
        q = batch.q[starts[i] : starts[i + 1]].float()  # [query_len, H, D]
        k = k.float().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        query_len, seq_len = q.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def run_ref(batch: PagedBatch) -> torch.Tensor:
    return paged_attention_ref(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.scale,
    )  # fmt: skip


def run_triton(batch: PagedBatch, **hints: int | None) -> torch.Tensor:
    from loraplex.kernels.triton_attention import paged_attention_triton

    return paged_attention_triton(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.scale, **hints,
    )  # fmt: skip


CASES = {
    "decode": [(1, 5), (1, 17), (1, 33)],
    "prefill": [(7, 7), (20, 20)],
    "cached_prefix": [(5, 37), (3, 19)],
    "chunk_across_blocks": [(20, 45)],
    "mixed": [(1, 30), (9, 9), (1, 1), (12, 40)],
}
HEADS = [(2, 2), (6, 2)]  # GQA ratios 1 and 3


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", HEADS)
def test_reference_matches_dense_attention(case: str, heads: tuple[int, int]) -> None:
    batch = make_batch(CASES[case], *heads, head_dim=64, dtype=torch.float32, fill=1e4)
    torch.testing.assert_close(run_ref(batch), dense_attention(batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_plan_matches_dense_attention(heads: tuple[int, int], dtype) -> None:
    """The CPU decode path (one gather plan for all layers) gives dense attention's output,
    whatever lies in the cache slots beyond each sequence (fill) and in unused table entries."""
    shapes = [(1, 5), (1, 17), (1, 1), (1, 33), (1, 16)]
    batch = make_batch(shapes, *heads, head_dim=64, dtype=dtype, fill=1e4, seed=3)
    plan = decode_plan(batch.seq_lens, batch.block_tables, BLOCK_SIZE, 33)
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.scale, max_query_len=1, max_seq_len=33, plan=plan,
    )  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out.float(), dense_attention(batch), atol=tol, rtol=tol)


def test_cpu_decode_plan_refuses_a_length_past_its_tables() -> None:
    batch = make_batch([(1, 5)], 2, 2, head_dim=64, dtype=torch.float32)
    too_long = batch.block_tables.shape[1] * BLOCK_SIZE + 1
    with pytest.raises(ValueError, match="does not fit"):
        decode_plan(batch.seq_lens, batch.block_tables, BLOCK_SIZE, too_long)


# Every case at head_dim 64; head_dim 128 on the cases that cross tile and block boundaries.
TRITON_CASES = [(case, 64) for case in CASES] + [("mixed", 128), ("chunk_across_blocks", 128)]


@pytest.mark.parametrize("case,head_dim", TRITON_CASES)
@pytest.mark.parametrize("heads", HEADS)
def test_triton_matches_reference(case: str, heads: tuple[int, int], head_dim: int) -> None:
    batch = make_batch(CASES[case], *heads, head_dim=head_dim, seed=head_dim)
    max_query_len = max(q for q, _ in CASES[case])
    expected = dense_attention(batch)
    torch.testing.assert_close(run_ref(batch).float(), expected, atol=2e-3, rtol=2e-3)
    out = run_triton(batch, max_query_len=max_query_len)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case,num_splits", [("decode", 2), ("decode", 4), ("cached_prefix", 4)])
def test_split_kv_matches_single_pass(case: str, num_splits: int) -> None:
    batch = make_batch(CASES[case], 6, 2, head_dim=64, seed=num_splits)
    max_query_len = max(q for q, _ in CASES[case])
    out = run_triton(batch, max_query_len=max_query_len, num_splits=num_splits)
    torch.testing.assert_close(out.float(), dense_attention(batch), atol=2e-3, rtol=2e-3)


def test_stale_cache_memory_never_leaks_into_output() -> None:
    batch = make_batch(CASES["mixed"], 6, 2, head_dim=64, fill=float("nan"))
    out = run_triton(batch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), dense_attention(batch), atol=2e-3, rtol=2e-3)


def test_padding_sequence_gets_zero_output() -> None:
    batch = make_batch([(1, 9), (1, 1)], 2, 2, head_dim=64)
    seq_lens = batch.seq_lens.clone()
    seq_lens[1] = 0
    from loraplex.kernels.triton_attention import paged_attention_triton

    out = paged_attention_triton(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, seq_lens,
        batch.block_tables, batch.scale, max_query_len=1,
    )  # fmt: skip
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_wrapper_rejects_bad_inputs() -> None:
    from loraplex.kernels.triton_attention import paged_attention_triton

    batch = make_batch(CASES["decode"], 6, 2, head_dim=64)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention_triton(
            batch.q[:, :5], batch.k_cache, batch.v_cache, batch.query_start_loc,
            batch.seq_lens, batch.block_tables, batch.scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="int32"):
        paged_attention_triton(
            batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc.long(),
            batch.seq_lens, batch.block_tables, batch.scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(
            batch.q.float(), batch.k_cache, batch.v_cache, batch.query_start_loc,
            batch.seq_lens, batch.block_tables, batch.scale,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (12, 4)])
def test_triton_on_gpu_at_real_sizes(head_dim: int, heads: tuple[int, int]) -> None:
    shapes = [(1, 3000), (1, 77), (512, 512), (300, 1500), (1, 16)]
    batch = make_batch(shapes, *heads, head_dim, dtype=torch.bfloat16, device="cuda", fill=1e4)
    out = paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
        batch.block_tables, batch.scale, max_query_len=512,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), dense_attention(batch), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch_size,head_dim", [(2, 128), (64, 128), (7, 64)])
def test_triton_decode_on_gpu_with_graph_capture(batch_size: int, head_dim: int) -> None:
    shapes = [(1, 4000 - 37 * i) for i in range(batch_size)]
    batch = make_batch(shapes, 32, 8, head_dim, dtype=torch.bfloat16, device="cuda")
    expected = dense_attention(batch)

    def step() -> torch.Tensor:
        return paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables, batch.scale, max_query_len=1,
        )  # fmt: skip

    out = replayed(step)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def replayed(step) -> torch.Tensor:
    """`step()`'s output from a CUDA graph captured after a first (autotuning) call, replayed."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    return out


# A verification graph's layout (runner/cuda_graph.verify_layout): every sequence owns k + 1 = 4
# query rows and its real tokens (1 + its drafts) are the last of them; a padded sequence has
# length 0. (query rows, real tokens, context length incl. the real tokens) per sequence.
VERIFY_ROWS = [(4, 1, 20), (4, 4, 37), (4, 3, 3), (4, 2, 17), (4, 0, 0)]


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_verification_layout_gives_the_real_tokens_dense_attention(num_splits) -> None:
    """Padding queries in front of a sequence's real ones (some before its first position),
    a padded sequence, and no max_seq_len hint (as under capture): the real tokens get their
    own causal attention, every output is finite, the padded sequence's is zero."""
    batch = make_batch([(q, s) for q, _, s in VERIFY_ROWS], 6, 2, head_dim=64, fill=1e4, seed=5)
    real = torch.cat(
        [torch.arange(4 * i + 4 - n, 4 * i + 4) for i, (_, n, _) in enumerate(VERIFY_ROWS)]
    )
    expected = dense_attention(batch)[real]
    torch.testing.assert_close(run_ref(batch)[real].float(), expected, atol=2e-3, rtol=2e-3)
    out = run_triton(batch, max_query_len=4, num_splits=num_splits)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out[real].float(), expected, atol=2e-3, rtol=2e-3)
    assert torch.equal(out[16:], torch.zeros_like(out[16:]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verification_layout_on_gpu_with_graph_capture() -> None:
    """The verification layout at the 8B's head shape, replayed from a CUDA graph."""
    rows = [(5, 1, 3000), (5, 5, 777), (5, 3, 3), (5, 2, 1500)] + [(5, 0, 0)] * 4
    batch = make_batch([(q, s) for q, _, s in rows], 32, 8, 128, torch.bfloat16, "cuda")
    real = torch.cat([torch.arange(5 * i + 5 - n, 5 * i + 5) for i, (_, n, _) in enumerate(rows)])
    expected = dense_attention(batch)[real.cuda()]

    def step() -> torch.Tensor:
        return paged_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.query_start_loc, batch.seq_lens,
            batch.block_tables, batch.scale, max_query_len=5,
        )  # fmt: skip

    out = replayed(step)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out[real.cuda()].float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[20:], torch.zeros_like(out[20:]))
