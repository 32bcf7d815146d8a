"""Triton logprobs: `reference.logprobs_ref` (the sampled token's logprob and rank, the top-k)
in one pass over the raw logits and a small combining launch, with no log_softmax tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.sampling.triton_sampling import jit, num_chunks_for
from loraplex.kernels.sampling.types import MAX_CHUNKS

_BLOCK = 1024
_BIG_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _take_top(values, ids, top_v, top_i, K: tl.constexpr):
    # Merge a block's K best (value, id) into the running best [K] (which holds the K best
    # seen so far, any order): each round moves the block's best into the running worst slot.
    slots = tl.arange(0, K)
    for _ in tl.static_range(K):
        best = tl.max(values, axis=0)
        best_id = tl.min(tl.where(values == best, ids, _BIG_INDEX), axis=0)
        worst = tl.min(top_v, axis=0)
        worst_slot = tl.min(tl.where(top_v == worst, slots, K), axis=0)
        hit = (slots == worst_slot) & (top_v < best)
        top_v = tl.where(hit, best, top_v)
        top_i = tl.where(hit, best_id, top_i)
        values = tl.where(ids == best_id, float("-inf"), values)
    return top_v, top_i


@jit
def _logprobs_kernel(
    logits_ptr, stride_l, token_ptr, part_m_ptr, part_s_ptr, part_rank_ptr, part_v_ptr,
    part_i_ptr, vocab, chunk, num_chunks, K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program: tokens [start, start + chunk) of a row -> its max, sum of exp(l - max),
    # number of tokens above the sampled one, and its K best tokens.
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_l
    chosen = tl.load(row_ptr + tl.load(token_ptr + row))
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    lane = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    above = tl.zeros([], tl.int32)
    top_v = tl.full([K], float("-inf"), tl.float32)
    top_i = tl.full([K], _BIG_INDEX, tl.int32)
    for base in range(start, end, BLOCK):
        idx = base + lane
        x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf"))
        new_m = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - new_m))
        s = s * scale + tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m)), axis=0)
        m = new_m
        above += tl.sum((x > chosen).to(tl.int32), axis=0)
        if tl.max(x, axis=0) > tl.min(top_v, axis=0):
            top_v, top_i = _take_top(x, idx, top_v, top_i, K)
    at = row * num_chunks + part
    tl.store(part_m_ptr + at, m)
    tl.store(part_s_ptr + at, s)
    tl.store(part_rank_ptr + at, above)
    tl.store(part_v_ptr + at * K + tl.arange(0, K), top_v)
    tl.store(part_i_ptr + at * K + tl.arange(0, K), top_i)


@jit
def _logprobs_combine_kernel(
    logits_ptr, stride_l, token_ptr, part_m_ptr, part_s_ptr, part_rank_ptr, part_v_ptr,
    part_i_ptr, token_lp_ptr, rank_ptr, top_id_ptr, top_lp_ptr, num_chunks, k,
    K: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    at = row * num_chunks + c
    pm = tl.load(part_m_ptr + at, mask=c < num_chunks, other=float("-inf"))
    ps = tl.load(part_s_ptr + at, mask=c < num_chunks, other=0.0)
    m = tl.max(pm, axis=0)
    s = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - m)), axis=0)
    lse = m + tl.log(s)
    rank = tl.sum(tl.load(part_rank_ptr + at, mask=c < num_chunks, other=0), axis=0) + 1
    chosen = tl.load(logits_ptr + row * stride_l + tl.load(token_ptr + row))
    tl.store(token_lp_ptr + row, chosen - lse)
    tl.store(rank_ptr + row, rank.to(tl.int64))
    # the K best of the chunks' candidates, best first
    cand = (row * num_chunks) * K + tl.arange(0, BLOCK_C * K)
    valid = tl.arange(0, BLOCK_C * K) < num_chunks * K
    values = tl.load(part_v_ptr + cand, mask=valid, other=float("-inf"))
    ids = tl.load(part_i_ptr + cand, mask=valid, other=_BIG_INDEX)
    for r in tl.static_range(K):
        best = tl.max(values, axis=0)
        best_id = tl.min(tl.where(values == best, ids, _BIG_INDEX), axis=0)
        if r < k:
            tl.store(top_lp_ptr + row * k + r, best - lse)
            tl.store(top_id_ptr + row * k + r, best_id.to(tl.int64))
        values = tl.where(ids == best_id, float("-inf"), values)


def logprobs_triton(
    logits: torch.Tensor,  # [n, vocab] fp32, unit stride along vocab
    token_ids: torch.Tensor,  # [n] int64
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.logprobs_ref` in two launches. -> token logprobs [n], ranks [n] int64, top-k
    ids [n, k] int64 and logprobs [n, k]"""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    dev = logits.device
    token_lp = torch.empty(n, dtype=torch.float32, device=dev)
    ranks = torch.empty(n, dtype=torch.int64, device=dev)
    top_ids = torch.empty(n, k, dtype=torch.int64, device=dev)
    top_lp = torch.empty(n, k, dtype=torch.float32, device=dev)
    if n == 0:
        return token_lp, ranks, top_ids, top_lp
    kp = triton.next_power_of_2(max(k, 1))
    chunks = num_chunks_for(n, vocab, dev)
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), _BLOCK) * _BLOCK
    chunks = triton.cdiv(vocab, chunk)
    part_m = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    part_s = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    part_rank = torch.empty(n, chunks, dtype=torch.int32, device=dev)
    part_v = torch.empty(n, chunks, kp, dtype=torch.float32, device=dev)
    part_i = torch.empty(n, chunks, kp, dtype=torch.int32, device=dev)
    tokens = token_ids.contiguous()
    parts = (part_m, part_s, part_rank, part_v, part_i)
    _logprobs_kernel[(n, chunks)](
        logits, logits.stride(0), tokens, *parts, vocab, chunk, chunks, K=kp, BLOCK=_BLOCK
    )
    _logprobs_combine_kernel[(n,)](
        logits, logits.stride(0), tokens, *parts, token_lp, ranks, top_ids, top_lp, chunks, k,
        K=kp, BLOCK_C=MAX_CHUNKS,
    )  # fmt: skip
    return token_lp, ranks, top_ids, top_lp
