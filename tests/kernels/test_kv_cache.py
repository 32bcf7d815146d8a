"""KV-cache write by slot mapping: the Triton kernel against the torch reference."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.kv_cache import write_kv_cache, write_kv_cache_ref


def _case(num_tokens: int, num_kv_heads: int, head_dim: int, device: str = "cpu", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = 7, 16
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(cache_shape, generator=gen).to(torch.bfloat16)
    return [t.to(device) for t in (k, v, k_cache, v_cache, slots)]


@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim", [(1, 1, 64), (13, 3, 64), (37, 2, 128)]
)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_triton_write_matches_reference(
    num_tokens: int, num_kv_heads: int, head_dim: int, slot_dtype: torch.dtype
) -> None:
    from loraplex.kernels.triton_kv_cache import write_kv_cache_triton

    k, v, k_cache, v_cache, slots = _case(num_tokens, num_kv_heads, head_dim, seed=num_tokens)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, k_ref, v_ref, slots)
    write_kv_cache_triton(k, v, k_cache, v_cache, slots.to(slot_dtype))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_write_reads_strided_kv_views() -> None:
    from loraplex.kernels.triton_kv_cache import write_kv_cache_triton

    k, v, k_cache, v_cache, slots = _case(9, 2, 64)
    kv = torch.cat([k, v], dim=1)  # [num_tokens, 2 * num_kv_heads, head_dim], as from a qkv split
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, k_ref, v_ref, slots)
    write_kv_cache_triton(kv[:, :2], kv[:, 2:], k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_padding_slots_leave_cache_untouched() -> None:
    from loraplex.kernels.triton_kv_cache import write_kv_cache_triton

    k, v, k_cache, v_cache, slots = _case(5, 2, 64)
    before = k_cache.clone()
    write_kv_cache_triton(k, v, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, before)


def test_wrapper_rejects_mismatched_cache() -> None:
    from loraplex.kernels.triton_kv_cache import write_kv_cache_triton

    k, v, k_cache, v_cache, slots = _case(5, 2, 64)
    with pytest.raises(ValueError, match="caches"):
        write_kv_cache_triton(k, v, k_cache[:, :, :1], v_cache[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(k, v, k_cache, v_cache, slots.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_write_on_gpu_at_real_sizes() -> None:
    num_tokens, num_kv_heads, head_dim, num_blocks = 4096, 8, 128, 2048
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * 16, device="cuda")[:num_tokens]
    k_cache = torch.zeros(num_blocks, 16, num_kv_heads, head_dim, device="cuda", dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, k_ref, v_ref, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
