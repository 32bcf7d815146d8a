"""Rotary embedding: the Triton kernels (plain, and fused with the KV-cache write) against the
torch reference, and llama3 scaling."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    cos_sin_cache,
    rope_inv_freq,
    rotary_write_kv,
    rotary_write_kv_ref,
)

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


def _fused_case(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """q/k/v as views of one fused qkv output (as the model passes them), random caches."""
    gen = torch.Generator().manual_seed(num_tokens * 31 + head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    num_blocks, block_size = 5, 4
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::3] = -1  # padding rows
    x = dict(
        positions=torch.randint(0, 4000, (num_tokens,), generator=gen),
        qkv=qkv,
        cache=cos_sin_cache(head_dim, 4096, 500000.0, LLAMA3),
        k_cache=torch.randn(cache_shape, generator=gen).to(cache_dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(cache_dtype),
        slot_mapping=slots,
    )
    x = {name: t.to(device) for name, t in x.items()}
    q, k, v = x["qkv"].split([q_size, kv_size, kv_size], dim=-1)
    x["q"] = q.view(num_tokens, num_heads, head_dim)
    x["k"] = k.view(num_tokens, num_kv_heads, head_dim)
    x["v"] = v.view(num_tokens, num_kv_heads, head_dim)
    return x


def _run(fn, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rotated q, k cache, v cache) after `fn` ran on fresh copies of x's caches."""
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    q = fn(x["positions"], x["q"], x["k"], x["v"], x["cache"], k_cache, v_cache, x["slot_mapping"])
    return q, k_cache, v_cache


def _assert_fused_matches_reference(x: dict[str, torch.Tensor], fn) -> None:
    qkv_before = x["qkv"].clone()
    q_out, k_cache, v_cache = _run(fn, x)
    q_ref, k_ref, v_ref = _run(rotary_write_kv_ref, x)
    assert q_out.is_contiguous() and q_out.shape == x["q"].shape
    torch.testing.assert_close(q_out, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_cache, k_ref, atol=1e-2, rtol=1e-2)
    # NOTE: v is copied, not rotated, so it matches exactly, except when it narrows into the
    # cache: the Triton interpreter truncates fp32 -> bf16 where torch and the GPU round.
    if x["v"].dtype == v_cache.dtype:
        assert torch.equal(v_cache, v_ref)
    torch.testing.assert_close(v_cache, v_ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(x["qkv"], qkv_before)  # inputs untouched


@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim", [
    (1, 1, 1, 64), (9, 6, 2, 64), (5, 4, 2, 128), (7, 3, 1, 96),
])  # fmt: skip
def test_fused_rotary_write_kv_matches_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    from loraplex.kernels.triton_rotary import rotary_write_kv_triton

    x = _fused_case(num_tokens, num_heads, num_kv_heads, head_dim)
    _assert_fused_matches_reference(x, rotary_write_kv_triton)


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
])  # fmt: skip
def test_fused_casts_into_a_cache_of_another_dtype(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    from loraplex.kernels.triton_rotary import rotary_write_kv_triton

    x = _fused_case(6, 4, 2, 64, dtype=dtype, cache_dtype=cache_dtype)
    _assert_fused_matches_reference(x, rotary_write_kv_triton)


def test_fused_rotated_k_lands_in_its_slot_and_padding_rows_write_nothing() -> None:
    from loraplex.kernels.triton_rotary import rotary_write_kv_triton

    x = _fused_case(6, 4, 2, 64)
    x["slot_mapping"] = torch.tensor([13, -1, 0, -1, -1, 7])
    q_out, k_cache, v_cache = _run(rotary_write_kv_triton, x)
    _, k_rot = apply_rotary_ref(x["positions"], x["q"], x["k"], x["cache"])
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_slots, kv_heads, dim]
    for token, slot in ((0, 13), (2, 0), (5, 7)):
        torch.testing.assert_close(flat_k[slot], k_rot[token], atol=1e-2, rtol=1e-2)
        assert torch.equal(flat_v[slot], x["v"][token])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[[13, 0, 7]] = False
    assert torch.equal(flat_k[untouched], x["k_cache"].flatten(0, 1)[untouched])
    assert torch.equal(flat_v[untouched], x["v_cache"].flatten(0, 1)[untouched])
    q_rot, _ = apply_rotary_ref(x["positions"], x["q"], x["k"], x["cache"])
    torch.testing.assert_close(q_out, q_rot, atol=1e-2, rtol=1e-2)  # padding rows still rotate


def test_fused_wrapper_rejects_bad_inputs() -> None:
    from loraplex.kernels.triton_rotary import rotary_write_kv_triton

    x = _fused_case(5, 4, 2, 64)
    args = [x[name] for name in ("positions", "q", "k", "v", "cache", "k_cache", "v_cache")]
    args.append(x["slot_mapping"])

    def call(**changes: torch.Tensor) -> None:
        names = ("positions", "q", "k", "v", "cache", "k_cache", "v_cache", "slot_mapping")
        rotary_write_kv_triton(*[changes.get(name, arg) for name, arg in zip(names, args)])

    with pytest.raises(ValueError, match="k and v must both be"):
        call(v=x["v"][:, :1])
    with pytest.raises(ValueError, match="caches"):
        call(k_cache=x["k_cache"][:, :, :1], v_cache=x["v_cache"][:, :, :1])
    with pytest.raises(ValueError, match="slot_mapping"):
        call(slot_mapping=x["slot_mapping"].float())
    with pytest.raises(ValueError, match="positions"):
        call(positions=x["positions"][:3])
    with pytest.raises(ValueError, match="cache"):
        call(cache=x["cache"][:, :32])
    with pytest.raises(ValueError, match="one device"):
        call(k_cache=x["k_cache"].to("meta"))


def test_fused_on_cpu_runs_the_two_step_reference() -> None:
    x = _fused_case(5, 4, 2, 64)
    q_out, k_cache, v_cache = _run(rotary_write_kv, x)
    q_rot, k_rot = apply_rotary_ref(x["positions"], x["q"], x["k"], x["cache"])
    assert torch.equal(q_out, q_rot)
    slots = x["slot_mapping"]
    valid = slots >= 0
    assert torch.equal(k_cache.flatten(0, 1)[slots[valid]], k_rot[valid])
    assert torch.equal(v_cache.flatten(0, 1)[slots[valid]], x["v"][valid])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_without_padding_equals_the_reference(dtype: torch.dtype) -> None:
    """The CPU path's no-padding write (every slot valid, as in an eager step) and its one
    rotation of q and k together give the reference's values bit for bit."""
    x = _fused_case(7, 9, 3, 64, dtype=dtype, cache_dtype=dtype)
    x["slot_mapping"] = torch.randperm(20, generator=torch.Generator().manual_seed(1))[:7]
    q_out, k_cache, v_cache = _run(rotary_write_kv, x)
    q_ref, k_ref, v_ref = _run(rotary_write_kv_ref, x)
    assert torch.equal(q_out, q_ref) and q_out.is_contiguous()
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpu_at_real_sizes() -> None:
    positions, q, k, cache = _inputs(4096, 32, 8, 128, "cuda")
    q_out, k_out = apply_rotary(positions, q, k, cache)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cache)
    torch.testing.assert_close(q_out, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_out, k_ref, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_on_gpu_at_real_sizes() -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 300, 32, 8, 128
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    cache = cos_sin_cache(head_dim, 8192, 500000.0, LLAMA3).cuda()
    k_cache = torch.randn(64, 16, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(64 * 16, device="cuda")[:num_tokens]
    slots[::7] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = rotary_write_kv_ref(positions, q, k, v, cache, k_ref, v_ref, slots)
    q_out = rotary_write_kv(positions, q, k, v, cache, k_cache, v_cache, slots)
    torch.testing.assert_close(q_out, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_cache, k_ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(v_cache, v_ref)
