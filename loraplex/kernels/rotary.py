"""Rotary position embedding (neox / rotate-half layout), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from loraplex.kernels.kv_cache import write_kv_cache_ref


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], scaled as `rope_scaling` says (None, llama3, linear)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled).float()
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """[max_positions, head_dim] in fp32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rotary_ref(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [max_positions, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cache[positions.long()].chunk(2, dim=-1)  # [num_tokens, head_dim // 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [num_tokens, num_heads, head_dim] and k; Triton on CUDA.

    `cache` comes from `cos_sin_cache` and must live on q's device.
    """
    if q.is_cuda:
        from loraplex.kernels.triton_rotary import apply_rotary_triton

        return apply_rotary_triton(positions, q, k, cache)
    return apply_rotary_ref(positions, q, k, cache)


def rotary_write_kv_ref(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [max_positions, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = padding (skipped)
) -> torch.Tensor:
    q, k = apply_rotary_ref(positions, q, k, cache)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotated q [num_tokens, num_heads, head_dim]; writes rotated k and v into the caches.

    One launch on CUDA (Triton) for `apply_rotary` followed by `write_kv_cache`: the caches are
    [num_blocks, block_size, num_kv_heads, head_dim], written in place at `slot_mapping`
    (slot = block * block_size + offset, -1 = padding row, nothing written). q, k and v may be
    strided views of one fused qkv projection; the returned q is a new contiguous tensor.
    """
    if q.is_cuda:
        from loraplex.kernels.triton_rotary import rotary_write_kv_triton

        return rotary_write_kv_triton(positions, q, k, v, cache, k_cache, v_cache, slot_mapping)
    return rotary_write_kv_ref(positions, q, k, v, cache, k_cache, v_cache, slot_mapping)
