"""Rotary embedding: the Triton kernel against the torch reference, and llama3 scaling."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.kernels.rotary import apply_rotary, apply_rotary_ref, cos_sin_cache, rope_inv_freq

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, device="cpu"):
    gen = torch.Generator().manual_seed(num_tokens)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen).to(device)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(torch.bfloat16).to(device)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    cache = cos_sin_cache(head_dim, 4096, 500000.0, LLAMA3).to(device)
    return positions, q, k.to(device), cache


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim", [
    (1, 1, 1, 64), (9, 6, 2, 64), (5, 3, 3, 128), (17, 4, 1, 96),
])  # fmt: skip
def test_triton_matches_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    from loraplex.kernels.triton_rotary import apply_rotary_triton

    positions, q, k, cache = _inputs(num_tokens, num_heads, num_kv_heads, head_dim)
    q_out, k_out = apply_rotary_triton(positions, q, k, cache)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_out, k_ref, atol=1e-2, rtol=1e-2)


def test_triton_reads_strided_views_of_a_fused_qkv() -> None:
    from loraplex.kernels.triton_rotary import apply_rotary_triton

    positions, q, k, cache = _inputs(7, 4, 2, 64)
    qkv = torch.cat([q, k, k], dim=1)  # [num_tokens, 4 + 2 + 2, head_dim]
    q_out, k_out = apply_rotary_triton(positions.int(), qkv[:, :4], qkv[:, 4:6], cache)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_out, k_ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(qkv[:, :4], q)  # inputs untouched


def test_llama3_scaling_keeps_high_divides_low_and_blends_medium_frequencies() -> None:
    plain = rope_inv_freq(128, 500000.0, None)
    scaled = rope_inv_freq(128, 500000.0, LLAMA3)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0  # shorter than original_max_position_embeddings / high_freq_factor
    low = wavelen > 8192 / 1.0
    medium = ~high & ~low
    assert high.any() and low.any() and medium.any()
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8.0)
    smooth = (8192 / wavelen[medium] - 1.0) / (4.0 - 1.0)
    blended = (1 - smooth) * plain[medium] / 8.0 + smooth * plain[medium]
    torch.testing.assert_close(scaled[medium], blended)
    assert ((scaled[medium] < plain[medium]) & (scaled[medium] > plain[medium] / 8.0)).all()


def test_position_zero_is_identity_and_rotation_keeps_norm() -> None:
    positions, q, k, cache = _inputs(6, 2, 2, 64)
    positions[0] = 0
    q_out, _ = apply_rotary_ref(positions, q, k, cache)
    assert torch.equal(q_out[0], q[0])
    torch.testing.assert_close(
        q_out.float().norm(dim=-1), q.float().norm(dim=-1), rtol=2e-2, atol=0
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_at_real_sizes() -> None:
    positions, q, k, cache = _inputs(4096, 32, 8, 128, "cuda")
    q_out, k_out = apply_rotary(positions, q, k, cache)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_out, k_ref, atol=1e-2, rtol=1e-2)
