"""Paged attention over the block-table KV cache, for mixed prefill / decode batches.

Batch layout (DESIGN.md): the new tokens of all sequences are flattened; sequence i owns query
rows `query_start_loc[i]:query_start_loc[i+1]`, and its context is `seq_lens[i]` tokens long,
the new ones last. The new tokens' K/V are already in the cache (`write_kv_cache` runs first),
so each query attends to every cached position up to and including its own (causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        qlen, ctx_len = query_lens[i], lens[i]
        num_blocks = -(-ctx_len // block_size)
        table = block_tables[i, :num_blocks].long()
        k = k_cache[table].flatten(0, 1)[:ctx_len]  # [L, Hk, D]
        v = v_cache[table].flatten(0, 1)[:ctx_len]
        q_pos = torch.arange(ctx_len - qlen, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [qlen, L]
        o = F.scaled_dot_product_attention(
            q[starts[i] : starts[i + 1]].transpose(0, 1).to(k.dtype),  # [H, qlen, D]
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask[None],
            scale=scale,
            enable_gqa=gqa,
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1).to(out.dtype)
    return out


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
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Dispatch: the Triton kernel on CUDA, the torch reference elsewhere.

    `max_query_len` / `max_seq_len` are optional host-side ints the runner already knows; the
    Triton path uses them to pick its grid without reading the device (see
    `paged_attention_triton`), the reference ignores them.
    """
    if q.is_cuda:
        from loraplex.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
        )  # fmt: skip
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale)
