"""Paged attention over the block-table KV cache, for mixed prefill / decode batches.

Batch layout (DESIGN.md): the new tokens of all sequences are flattened; sequence i owns query
rows `query_start_loc[i]:query_start_loc[i+1]`, and its context is `seq_lens[i]` tokens long,
the new ones last. The new tokens' K/V are already in the cache (`write_kv_cache` runs first),
so each query attends to every cached position up to and including its own (causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_attention


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Plain-torch paged attention: decode rows batched, prefill rows one sequence at a time."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    num_seqs = len(lens)
    query_lens = [starts[i + 1] - starts[i] for i in range(num_seqs)]
    decode = [i for i in range(num_seqs) if query_lens[i] == 1]
    prefill = [i for i in range(num_seqs) if query_lens[i] > 1]
    gqa = num_heads != num_kv_heads

    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        ctx = torch.tensor([lens[i] for i in decode], device=q.device)
        max_len = int(max(lens[i] for i in decode))
        max_blocks = -(-max_len // block_size)
        tables = block_tables[decode, :max_blocks].long()  # [B, max_blocks]
        k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, L, Hk, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len]
        mask = torch.arange(max_len, device=q.device)[None, :] < ctx[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2).to(k.dtype),  # [B, H, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=gqa,
        )  # [B, H, 1, D]
        out[rows] = o.squeeze(2).to(out.dtype)

    for i in prefill:
        out[starts[i] : starts[i + 1]] = _prefill_rows(
            q, k_cache, v_cache, starts[i], starts[i + 1], lens[i], block_tables[i], scale
        )
    return out


def _prefill_rows(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    start: int,
    end: int,
    ctx_len: int,
    table: torch.Tensor,  # [max_blocks] int32: this sequence's block table
    scale: float,
) -> torch.Tensor:  # [end - start, num_heads, head_dim]
    """Causal attention of one sequence's query rows `start:end`, the last of its `ctx_len`."""
    qlen, block_size = end - start, k_cache.shape[1]
    blocks = table[: -(-ctx_len // block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:ctx_len]  # [L, Hk, D]
    v = v_cache[blocks].flatten(0, 1)[:ctx_len]
    q_pos = torch.arange(ctx_len - qlen, ctx_len, device=q.device)
    mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [qlen, L]
    o = F.scaled_dot_product_attention(
        q[start:end].transpose(0, 1).to(k.dtype),  # [H, qlen, D]
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask[None],
        scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[2],
    )
    return o.transpose(0, 1).to(q.dtype)


@dataclass(frozen=True)
class DecodePlan:
    """Where each decode query's context lies in the cache, worked out once per step for all
    layers (their block tables and lengths are the same): the CPU decode path's gather indices.

    On CPU the per-layer share of working this out (block-table gathers, masks, host reads of
    the lengths) cost about as much as the attention itself at batch 1."""

    slots: torch.Tensor  # [num_seqs * max_seq_len] int64 cache slots, padded rows at slot 0
    mask: torch.Tensor  # [num_seqs, 1, 1, max_seq_len] bool, True where a slot is in context
    max_seq_len: int


def decode_plan(
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    block_size: int,
    max_seq_len: int,
) -> DecodePlan:
    """The gather indices of a batch in which every sequence has one query token."""
    if max_seq_len < 1 or max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_seq_len {max_seq_len} does not fit the block tables")
    pos = torch.arange(max_seq_len, device=seq_lens.device)  # [L]
    in_context = pos[None, :] < seq_lens.long()[:, None]  # [B, L]
    slots = block_tables[:, pos // block_size].long() * block_size + pos % block_size  # [B, L]
    slots = slots.masked_fill(~in_context, 0)
    return DecodePlan(slots.flatten(), in_context[:, None, None, :], max_seq_len)


def paged_decode_cpu(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one query per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Decode attention over the cache slots `plan` names: one gather of K and V per layer and
    one fused attention call, nothing read back to the host."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.slots)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.slots)
    shape = (num_seqs, plan.max_seq_len, num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2).to(k.dtype),  # [B, H, 1, D]
        k.view(shape).transpose(1, 2),  # [B, Hk, L, D]
        v.view(shape).transpose(1, 2),
        attn_mask=plan.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H, 1, D]
    return o.squeeze(2).to(q.dtype)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Dispatch: the Triton kernel on CUDA; on CPU in fp32 the C kernel of `cpu_attention`
    (given `max_seq_len`; a sequence with a query over its MAX_QUERY_LEN tokens through torch's
    SDPA); where that cannot run, `paged_decode_cpu` when the step is all decode and brings its
    `plan` (`decode_plan`), the torch reference otherwise.

    `max_query_len` / `max_seq_len` are optional host-side ints the runner already knows; the
    Triton path uses them to pick its grid without reading the device (see
    `paged_attention_triton`), the C kernel sizes its scores with `max_seq_len`, the reference
    ignores them.
    """
    if q.is_cuda:
        from loraplex.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )  # fmt: skip
    if max_seq_len is not None and cpu_attention.supports(q, k_cache, v_cache):
        out = torch.empty_like(q)
        if cpu_attention.paged_attention_c(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_seq_len, out
        ):
            if max_query_len is None or max_query_len > cpu_attention.MAX_QUERY_LEN:
                _long_prefills(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                               scale, out)  # fmt: skip
            return out
    if plan is not None:
        if plan.mask.shape[0] != q.shape[0]:
            raise ValueError(f"the plan has {plan.mask.shape[0]} rows, q {q.shape[0]}")
        return paged_decode_cpu(q, k_cache, v_cache, plan, scale)
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)


def _long_prefills(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> None:
    """The rows of the sequences the C kernel leaves out (queries over its MAX_QUERY_LEN)."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        if starts[i + 1] - starts[i] > cpu_attention.MAX_QUERY_LEN:
            out[starts[i] : starts[i + 1]] = _prefill_rows(
                q, k_cache, v_cache, starts[i], starts[i + 1], ctx_len, block_tables[i], scale
            )
