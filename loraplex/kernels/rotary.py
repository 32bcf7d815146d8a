"""Rotary position embedding (neox / rotate-half layout): plain, linear, Llama 3 and YaRN."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from loraplex.kernels import cpu_rotary
from loraplex.kernels.kv_cache import write_kv_cache_ref


def _required(scaling: Mapping[str, Any], key: str) -> Any:
    if scaling.get(key) is None:
        raise ValueError(f"rope scaling {scaling.get('rope_type')!r} needs {key!r}")
    return scaling[key]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a blend between."""
    factor = float(_required(scaling, "factor"))
    low = float(_required(scaling, "low_freq_factor"))
    high = float(_required(scaling, "high_freq_factor"))
    old_len = float(_required(scaling, "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: Mapping[str, Any]
) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those turning more than `beta_fast` times are kept, with
    a linear ramp between."""
    factor = float(_required(scaling, "factor"))
    old_len = float(_required(scaling, "original_max_position_embeddings"))
    beta_fast = float(_required(scaling, "beta_fast"))
    beta_slow = float(_required(scaling, "beta_slow"))

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times into the original context
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if _required(scaling, "truncate"):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (fp32) for RoPE with base `theta`.

    `scaling` is None (plain RoPE) or a dict whose `rope_type` is linear (`factor`), llama3
    (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`) or
    yarn (`factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `truncate`,
    `attention_factor`), every value given: config.json is resolved by
    `loraplex.platform.models.rope_config`, not here.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(_required(scaling, "factor"))).float()
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling).float()
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3, yarn)")


def cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: Mapping[str, Any] | None
) -> torch.Tensor:
    """[max_positions, head_dim] in fp32: cos in the first half, sin in the second.

    Both are multiplied by yarn's `attention_factor` when `scaling` has one (1 otherwise).
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    attention_factor = float((scaling or {}).get("attention_factor") or 1.0)
    return cache * attention_factor if attention_factor != 1.0 else cache


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
    return rotary_write_kv_cpu(positions, q, k, v, cache, k_cache, v_cache, slot_mapping)


def rotary_write_kv_cpu(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: torch.Tensor,  # [max_positions, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = padding (skipped)
) -> torch.Tensor:
    """`rotary_write_kv_ref` in one C call (`cpu_rotary`) for fp32, else in about half the
    torch ops (q and k rotated as one tensor, no boolean indexing where no slot is padding);
    each output element computed by the same float ops either way."""
    if positions.shape == slot_mapping.shape == q.shape[:1] and cpu_rotary.supports(
        q, k, v, cache, k_cache, v_cache
    ):
        out = cpu_rotary.rotary_write_kv_c(
            positions, q, k, v, cache, k_cache, v_cache, slot_mapping
        )
        if out is not None:
            return out
    num_heads = q.shape[1]
    cos, sin = cache[positions.long()].chunk(2, dim=-1)  # [num_tokens, head_dim // 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    qk = torch.cat([q, k], dim=1).float()  # [num_tokens, num_heads + num_kv_heads, head_dim]
    x1, x2 = qk.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(q.dtype)
    k_rot = rotated[:, num_heads:]
    if bool((slot_mapping < 0).any()):
        write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    else:
        slots = slot_mapping.long()
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k_rot.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
    return rotated[:, :num_heads].contiguous()
