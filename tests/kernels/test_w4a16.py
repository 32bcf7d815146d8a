"""The W4A16 / W8A16 family: the Triton kernels (interpreter on CPU, compiled on the GPU) against
the plain-torch reference on random weights of odd sizes, every launch kind, both bit widths,
act-order, group sizes and split-K; the layout, the dispatch and the wrapper's checks."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.w4a16 import w4a16_dequantize, w4a16_gemm, w4a16_gemm_triton
from loraplex.kernels.w4a16.dispatch import (
    M_BUCKETS,
    TUNED_CONFIGS,
    heuristic_config,
    read_selection_table,
    select_config,
    use_selection_table,
    write_selection_table,
)
from loraplex.kernels.w4a16.reference import (
    dequantize_reference,
    unpack_values,
    w4a16_gemm_reference,
)
from loraplex.kernels.w4a16.types import TILE_K, W4A16Config, scale_dots, tile_features
from loraplex.quant.w4a16_repack import repack_w4a16


def _weights(bits: int, n: int, k: int, group_size: int, act_order: bool, seed: int = 0,
             device: str = "cpu"):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).half()
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    tensors = (repack_w4a16(values, bits), scales, zeros, perm)
    return tuple(t.to(device) if t is not None else None for t in tensors)


KINDS = [W4A16Config("mma", 16, 32, 2, 4, 2), W4A16Config("mma_wscale", 16, 32, 1, 4, 2),
         W4A16Config("mma", 16, 32, 3, 4, 2, prefetch=True), W4A16Config("dequant", 16, 16, 1, 4, 1)]  # fmt: skip


@pytest.mark.parametrize(
    ("bits", "m", "n", "k", "group_size", "act_order"),
    [(4, 1, 40, 96, 32, False), (4, 5, 24, 256, 64, True), (4, 3, 72, 160, 160, False),
     (4, 33, 56, 384, 128, True), (8, 17, 56, 192, 64, False), (8, 2, 24, 128, 32, True),
     (4, 2, 24, 96, 16, False)],
)  # fmt: skip
@pytest.mark.parametrize(
    "config", KINDS, ids=lambda c: c.kind + ("-prefetch" if c.prefetch else "")
)
def test_every_kind_matches_reference(bits, m, n, k, group_size, act_order, config) -> None:
    # NOTE: fp32 activations: the fused kernel's dot is exact ("ieee") there, so every kind
    # equals the fp32 reference to float rounding; fp16 below takes the magic-number path.
    q, scales, zeros, perm = _weights(bits, n, k, group_size, act_order)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    expected = w4a16_gemm_reference(x, q, scales, zeros, group_size, bits, perm, bias)
    for _ in range(2):  # the second call finds the split-K workspace zeroed again
        out = w4a16_gemm_triton(x, q, scales, zeros, group_size, bits, perm, bias, config)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("bits", "m", "group_size", "act_order", "split_k"),
    [(4, 1, 128, False, 1), (4, 5, 64, True, 2), (8, 3, 64, False, 2), (8, 2, 128, True, 1)],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["mma", "mma_wscale"])
def test_fp16_magic_number_path_matches_reference(
    bits, m, group_size, act_order, split_k, kind
) -> None:
    # NOTE: fp16 ORs each value into the mantissa of 1024: the exact weight v - z then differs
    # from the fp32 reference by the fp16 rounding of x, of the output and ("mma_wscale") of
    # the scaled weight. (bf16 runs in the GPU tests: the interpreter's bf16 dot is wrong.)
    q, scales, zeros, perm = _weights(bits, 40, 384, group_size, act_order, seed=5)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 384, generator=gen).half()
    bias = torch.randn(40, generator=gen).half()
    config = W4A16Config(kind, 16, 32, split_k, 4, 2)
    out = w4a16_gemm_triton(x, q, scales, zeros, group_size, bits, perm, bias, config)
    expected = w4a16_gemm_reference(
        x.float(), q, scales, zeros, group_size, bits, perm, bias.float()
    )
    assert out.dtype == torch.float16
    atol = 2**-10 * float(expected.abs().max())  # the output's own rounding, at its largest
    torch.testing.assert_close(out.float(), expected, rtol=2**-9, atol=atol)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (8, 48)])
def test_dequantize_kernel_matches_reference(bits: int, group_size: int) -> None:
    q, scales, zeros, _ = _weights(bits, 48, 144, group_size, False, seed=1)
    out = w4a16_dequantize(q, scales, zeros, group_size, bits, torch.float32)  # [N, K]
    torch.testing.assert_close(out.t(), dequantize_reference(q, scales, zeros, group_size, bits))


@pytest.mark.parametrize("bits", [4, 8])
def test_repack_round_trips_and_pads_k_to_whole_tiles(bits: int) -> None:
    values = torch.randint(0, 2**bits, (200, 24), dtype=torch.int32)
    q = repack_w4a16(values, bits)
    assert q.shape == (24, 256 * bits // 32)  # 200 features padded to two tiles
    assert torch.equal(unpack_values(q, bits, 200), values)


def test_the_layout_puts_two_adjacent_features_in_each_half_word_pair() -> None:
    # Word slot 0 of a row holds, at 4 bits, features 0, 32, 64, 96 in its low half (positions
    # 0..3) and 1, 33, 65, 97 in its high half; slot 1 holds operand column kw = 4 (features 8,
    # 9, ...): the words of one MMA fragment lane (kw = 0, 4, 8, 12) are slots 0..3.
    features = tile_features(4)
    assert features[0].tolist() == [0, 32, 64, 96, 1, 33, 65, 97]
    assert features[1].tolist() == [8, 40, 72, 104, 9, 41, 73, 105]
    assert sorted(features.flatten().tolist()) == list(range(TILE_K))
    values = torch.zeros(TILE_K, 1, dtype=torch.int32)
    values[33, 0] = 5  # position 5 of slot 0: bits 20..23
    assert repack_w4a16(values, 4)[0, 0].item() == 5 << 20


def test_groups_a_dot_cannot_scale_take_the_dequant_route() -> None:
    assert scale_dots(128, 4096, 4) == 4 and scale_dots(32, 4096, 4) == 1
    assert scale_dots(64, 4096, 8) == 1 and scale_dots(4096, 4096, 4) == 4
    assert scale_dots(16, 4096, 4) == 0 and scale_dots(32, 4096, 8) == 0


def test_selection_table_file_overrides_the_tuned_table(tmp_path) -> None:
    path = tmp_path / "table.json"
    config = W4A16Config("mma", 16, 256, 4, 8, 4)
    write_selection_table(path, {(4, 4, 2048, 2048): config}, {"benchmark": "x"})
    assert read_selection_table(path) == {(4, 4, 2048, 2048): config}
    try:
        use_selection_table(path)
        assert select_config(3, 2048, 2048, 4) == config  # M 3 -> bucket 4
        assert select_config(16, 2048, 2048, 4) == heuristic_config(16)  # not in the file
    finally:
        use_selection_table(None)
    assert select_config(3, 2048, 2048, 4) == heuristic_config(3)
    path.write_text('{"w4a16": [{"bits": 4}]}')
    with pytest.raises(ValueError, match="bad W4A16 selection table"):
        read_selection_table(path)


def test_dispatch_covers_every_token_count_with_a_kind_the_sweep_chose() -> None:
    chosen = {c.kind for c in TUNED_CONFIGS.values()}
    for m in (1, 3, 16, 17, 64, 100, 256, 257, 4096, 9000):
        config = select_config(m, 2048, 2048, 4)  # an untuned shape: the heuristic
        assert not chosen or config.kind in chosen
        assert config.kind == "dequant" or config.block_m >= min(m, 16)
    assert all(key[1] in M_BUCKETS for key in TUNED_CONFIGS)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"bits": 3}, "bits must be 4 or 8"), ({"group_size": 48}, "group_size 48 must divide"),
     ({"x": torch.randn(2, 192)}, r"qweight must be int32 \[N, 32\] for K=192"),
     ({"scales": torch.ones(1, 16)}, r"scales must be float \[2, 16\]"),
     ({"perm": torch.arange(64)}, "perm must be int32")],
)  # fmt: skip
def test_wrapper_rejects_bad_inputs(change: dict, message: str) -> None:
    q, scales, zeros, _ = _weights(4, 16, 64, 32, False)
    args = {"x": torch.randn(2, 64), "qweight": q, "scales": scales, "zeros": zeros,
            "group_size": 32, "bits": 4, "perm": None} | change  # fmt: skip
    with pytest.raises(ValueError, match=message):
        w4a16_gemm(**args)


GPU_CONFIGS = [
    W4A16Config("mma", 16, 64, 0, 4, 4), W4A16Config("mma", 16, 128, 8, 4, 3),
    W4A16Config("mma", 16, 256, 0, 8, 3), W4A16Config("mma", 16, 64, 0, 2, 4),
    W4A16Config("mma", 64, 128, 0, 4, 3), W4A16Config("mma_wscale", 64, 128, 0, 4, 3),
    W4A16Config("mma_wscale", 128, 128, 2, 8, 3), W4A16Config("mma", 128, 128, 0, 8, 3),
    W4A16Config("mma_wscale", 256, 128, 1, 8, 3), W4A16Config("mma_wscale", 128, 256, 1, 8, 3),
    W4A16Config("dequant", 16, 64, 1, 4, 1), W4A16Config("mma", 16, 128, 4, 4, 3, True),
    W4A16Config("mma_wscale", 128, 128, 2, 8, 3, True), W4A16Config("mma", 16, 32, 0, 1, 8, True),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "config", GPU_CONFIGS, ids=lambda c: "-".join(map(str, c.__dict__.values()))
)
@pytest.mark.parametrize("m", [1, 16, 67, 300])
@pytest.mark.parametrize(("bits", "group_size", "act_order", "dtype"),
                         [(4, 128, False, torch.bfloat16), (4, 32, True, torch.float16),
                          (8, 64, False, torch.bfloat16)],
                         ids=["bf16-g128", "fp16-g32-act", "w8-bf16-g64"])  # fmt: skip
def test_gpu_kernels_match_reference(config, m, bits, group_size, act_order, dtype) -> None:
    n, k = 1000, 1408  # 11 tiles: splits of unequal length, N off every tile size
    q, scales, zeros, perm = _weights(bits, n, k, group_size, act_order, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = w4a16_gemm_triton(x, q, scales.to(dtype), zeros.to(dtype), group_size, bits, perm,
                            bias, config)  # fmt: skip
    w = dequantize_reference(q, scales.to(dtype), zeros.to(dtype), group_size, bits, perm)
    expected = x.float() @ w + bias.float()  # [m, n] fp32
    # NOTE: output rounding (half an ulp: 2**-9 relative in bf16) plus, where the weight is
    # rounded to x's dtype ("mma_wscale", "dequant"), 2**-9 per product, ~sqrt(K) adding up.
    atol = 4 * 2**-9 * k**0.5 * float(w.abs().max())
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64, 128, 1024])
def test_gpu_dispatch_at_the_8b_shapes_matches_reference(m: int) -> None:
    for n, k in ((6144, 4096), (4096, 14336)):
        q, scales, zeros, _ = _weights(4, n, k, 128, False, seed=m, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = w4a16_gemm(x, q, scales.bfloat16(), zeros.bfloat16(), 128, 4)
        expected = x.float() @ dequantize_reference(q, scales.bfloat16(), zeros.bfloat16(), 128, 4)
        err = float((out.float() - expected).norm() / expected.norm())
        assert err < 1e-2, (n, k, err)
