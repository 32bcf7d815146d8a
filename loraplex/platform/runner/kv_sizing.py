"""How many KV-cache blocks fit: the configured count, or what the device's memory leaves."""

from __future__ import annotations

import torch

from loraplex.config import CacheConfig
from loraplex.platform.models.arch_config import ArchConfig

# Headroom kept free on CUDA for activations, CUDA graphs and the sampler's lazily allocated
# penalty state.
ACTIVATION_RESERVE_BYTES = 2 << 30


def kv_block_bytes(
    arch: ArchConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """Bytes of one block of K and V over all layers (of `num_kv_heads` heads: a
    tensor-parallel rank's share; default all of the model's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * arch.num_layers * block_size * heads * arch.head_dim * elem


def num_kv_blocks(cache: CacheConfig, device: torch.device, block_bytes: int) -> int:
    """The configured block count, or as many blocks as the memory budget holds."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = total * cache.gpu_memory_utilization - used - ACTIVATION_RESERVE_BYTES
    else:
        budget = cache.cpu_kv_cache_gib * (1 << 30)
    num = int(budget // block_bytes)
    if num < 1:
        raise ValueError(
            "no memory left for the KV cache; lower the model size or raise "
            "--gpu-memory-utilization / cpu_kv_cache_gib"
        )
    return num
