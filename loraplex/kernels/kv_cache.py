"""Write new K/V rows into the paged cache at their slots (slot = block * block_size + offset)."""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = padding (skipped)
) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    flat_k.index_copy_(0, slots, k[valid].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, v[valid].to(v_cache.dtype))


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes K/V into the caches in place (padding slots -1 skipped); Triton on CUDA."""
    if k.is_cuda:
        from loraplex.kernels.triton_kv_cache import write_kv_cache_triton

        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
