"""The C rotary + KV-cache write of the CPU engine: the torch reference bit for bit on the
model's strided q/k/v views, padding rows left out, bad indices refused, torch where no C
compiler works or the dtype is not fp32."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from loraplex.kernels import cpu_native, cpu_rotary
from loraplex.kernels.rotary import rotary_write_kv, rotary_write_kv_ref
from tests.kernels.test_rotary import _fused_case, _run

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler on this host: the CPU rotary keeps its torch path "
    "(test_without_a_compiler_torch_gives_the_same_result)",
)


def _fp32_case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    return _fused_case(num_tokens, num_heads, num_kv_heads, head_dim, torch.float32, torch.float32)


@needs_compiler
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim", [
    (1, 9, 3, 64), (1, 1, 1, 2), (7, 6, 2, 64), (5, 3, 3, 128), (17, 4, 1, 96), (3, 5, 5, 10),
])  # fmt: skip
def test_c_equals_the_reference_bit_for_bit(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    x = _fp32_case(num_tokens, num_heads, num_kv_heads, head_dim)  # padding rows included
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    q_out = cpu_rotary.rotary_write_kv_c(
        x["positions"], x["q"], x["k"], x["v"], x["cache"], k_cache, v_cache, x["slot_mapping"]
    )
    q_ref, k_ref, v_ref = _run(rotary_write_kv_ref, x)
    assert q_out is not None and q_out.is_contiguous() and q_out.shape == x["q"].shape
    assert torch.equal(q_out, q_ref)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # padding wrote nothing


@needs_compiler
def test_the_engine_path_takes_c_for_fp32_and_torch_for_bf16(monkeypatch) -> None:
    calls = []
    real = cpu_rotary.rotary_write_kv_c
    monkeypatch.setattr(cpu_rotary, "rotary_write_kv_c", lambda *a: calls.append(1) or real(*a))
    for dtype in (torch.float32, torch.bfloat16):
        x = _fused_case(6, 4, 2, 64, dtype, dtype)
        q_out, k_cache, v_cache = _run(rotary_write_kv, x)
        q_ref, k_ref, v_ref = _run(rotary_write_kv_ref, x)
        assert torch.equal(q_out, q_ref) and torch.equal(k_cache, k_ref)
        assert torch.equal(v_cache, v_ref)
    assert calls == [1]


@needs_compiler
def test_positions_and_slots_out_of_range_are_refused() -> None:
    x = _fp32_case(4, 2, 1, 64)
    k_cache, v_cache = x["k_cache"].clone(), x["v_cache"].clone()
    args = [x["q"], x["k"], x["v"], x["cache"], k_cache, v_cache]
    with pytest.raises(IndexError, match="out of range"):
        cpu_rotary.rotary_write_kv_c(torch.tensor([0, 1, 4096, 2]), *args, x["slot_mapping"])
    with pytest.raises(IndexError, match="out of range"):
        cpu_rotary.rotary_write_kv_c(x["positions"], *args, torch.tensor([0, 1, 2, 20]))


def test_without_a_compiler_torch_gives_the_same_result(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "loraplex-no-such-compiler")
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path))
    cpu_native.load_library.cache_clear()
    try:
        x = _fp32_case(5, 4, 2, 64)
        assert cpu_rotary.rotary_write_kv_c(x["positions"], x["q"], x["k"], x["v"], x["cache"],
                                            x["k_cache"].clone(), x["v_cache"].clone(),
                                            x["slot_mapping"]) is None  # fmt: skip
        q_out, k_cache, v_cache = _run(rotary_write_kv, x)
        q_ref, k_ref, v_ref = _run(rotary_write_kv_ref, x)
        assert torch.equal(q_out, q_ref) and torch.equal(k_cache, k_ref)
        assert torch.equal(v_cache, v_ref)
    finally:
        cpu_native.load_library.cache_clear()
