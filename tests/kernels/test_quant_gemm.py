"""W4A16 / W8A16 dequant-GEMM: the Triton kernels (interpreter on CPU) against the torch
reference, on random weights of odd sizes, both bit widths, act-order, split-K and every kernel
kind."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.quant_gemm_configs import (
    ONE_ROW_KINDS,
    TUNED_CONFIGS,
    GemmConfig,
    read_selection_table,
    select_config,
    use_selection_table,
    without_shallow_slices,
    write_selection_table,
)
from loraplex.kernels.quant_gemm_w4a16 import (
    wna16_dequantize,
    wna16_dequantize_reference,
    wna16_gemm,
    wna16_gemm_reference,
    wna16_gemm_triton,
)


def _weights(bits: int, n: int, k: int, group_size: int, act_order: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pack = 32 // bits
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // pack, n), generator=gen, dtype=torch.int32)
    groups = k // group_size
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 1e-3).half()
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen).half()
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    return qweight, scales, zeros, perm


@pytest.mark.parametrize(
    ("bits", "m", "n", "k", "group_size", "act_order", "split_k"),
    [(4, 1, 40, 64, 32, False, 1), (4, 5, 24, 128, 64, True, 2), (8, 17, 56, 96, 96, False, 1),
     (8, 3, 8, 64, 16, True, 4), (4, 33, 72, 32, 32, False, 1)],
)  # fmt: skip
@pytest.mark.parametrize(
    "kind",
    ["gemm", "gemv", "fma", "gemm_t", "sliced", "sliced_t", "stream", "stream_pair"],
)
def test_fused_kernels_match_reference(bits, m, n, k, group_size, act_order, split_k, kind) -> None:
    qweight, scales, zeros, perm = _weights(bits, n, k, group_size, act_order)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    config = GemmConfig(kind, 1 if kind in ONE_ROW_KINDS else 16, 32, 32, split_k, 4, 2)
    expected = wna16_gemm_reference(x, qweight, scales, zeros, group_size, bits, perm, bias)
    # NOTE: "fma" sums x * 2**12 + x * v in fp32 and subtracts x * 2**12 per K tile, so in fp32
    # it keeps ~12 fewer bits than the other kernels (errors up to ~1e-4 here, seen over 40
    # random inputs); in bf16, its real dtype, the output's own rounding is far coarser.
    atol = 1e-3 if kind == "fma" else 1e-4
    for _ in range(2):  # the second call finds the split-K workspace zeroed again
        out = wna16_gemm_triton(x, qweight, scales, zeros, group_size, bits, perm, bias, config)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=atol)


@pytest.mark.parametrize(
    ("bits", "m", "group_size", "act_order", "split_k"),
    [(4, 1, 64, False, 1), (4, 3, 32, True, 2), (8, 2, 64, True, 4)],
)
def test_fma_kernel_in_bf16_matches_reference(bits, m, group_size, act_order, split_k) -> None:
    # NOTE: the FMA kernel's float trick is exact, so a bf16 call differs from the fp32
    # reference by the bf16 rounding of x (done before both) and of the output only.
    qweight, scales, zeros, perm = _weights(bits, 24, 64, group_size, act_order, seed=3)
    x = torch.randn(m, 64).bfloat16()
    config = GemmConfig("fma", 1, 16, 32, split_k, 4, 3)
    out = wna16_gemm_triton(x, qweight, scales, zeros, group_size, bits, perm, None, config)
    expected = wna16_gemm_reference(x.float(), qweight, scales, zeros, group_size, bits, perm)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize(
    ("bits", "m", "group_size", "act_order", "split_k"),
    [(4, 1, 128, False, 1), (4, 5, 128, True, 2), (8, 3, 64, False, 2), (8, 2, 64, True, 1)],
)
@pytest.mark.parametrize("kind", ["stream", "stream_pair"])
def test_stream_kernels_in_fp16_match_reference(
    bits, m, group_size, act_order, split_k, kind
) -> None:
    # NOTE: fp16 takes the magic-number path (two values per integer op, 1024 + v as bits);
    # the result differs from the fp32 reference by the fp16 rounding of x and of the output.
    # (bf16 runs in the GPU test: the interpreter's bf16 dot is wrong for every kernel.)
    qweight, scales, zeros, perm = _weights(bits, 40, 256, group_size, act_order, seed=5)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=gen).half()
    bias = torch.randn(40, generator=gen).half()
    config = GemmConfig(kind, 16, 32, group_size, split_k, 4, 2)
    out = wna16_gemm_triton(x, qweight, scales, zeros, group_size, bits, perm, bias, config)
    expected = wna16_gemm_reference(
        x.float(), qweight, scales, zeros, group_size, bits, perm, bias.float()
    )
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, rtol=2**-10, atol=1e-3)


def test_selection_table_file_overrides_the_tuned_table(tmp_path) -> None:
    path = tmp_path / "table.json"
    stream = GemmConfig("stream", 16, 256, 128, 4, 8, 4)
    write_selection_table(path, {(4, 4, 2048, 2048): stream})
    assert read_selection_table(path) == {(4, 4, 2048, 2048): stream}
    try:
        use_selection_table(path)
        picked = select_config(3, 2048, 2048, 128, 4, 132)  # M 3 -> bucket 4
        picked_fields = (picked.kind, picked.block_n, picked.split_k, picked.num_stages)
        assert picked_fields == ("stream", 256, 4, 4)
        assert select_config(16, 2048, 2048, 128, 4, 132).kind == "gemm"  # not in the file
    finally:
        use_selection_table(None)
    assert select_config(3, 2048, 2048, 128, 4, 132).kind == "sliced_t"
    path.write_text('{"w4a16": [{"bits": 4}]}')
    with pytest.raises(ValueError, match="bad W4A16 selection table"):
        read_selection_table(path)


def test_stream_falls_back_to_a_reshaping_kernel_for_small_groups() -> None:
    # A K tile of 64 4-bit features holds 8 words per value position: too shallow for a GPU dot.
    config = GemmConfig("stream", 16, 128, 64, 0, 4, 3)
    assert without_shallow_slices(config, 4).kind == "gemm_t"
    assert without_shallow_slices(GemmConfig("stream", 16, 128, 128, 0, 4, 3), 4).kind == "stream"


@pytest.mark.parametrize("chunk", [0, 16])
def test_chunked_dequant_matmul_matches_reference(chunk: int) -> None:
    qweight, scales, zeros, perm = _weights(4, 40, 64, 32, True, seed=2)
    x, bias = torch.randn(3, 64), torch.randn(40)
    config = GemmConfig("dequant", 0, chunk, 32, 1, 4, 1)
    out = wna16_gemm_triton(x, qweight, scales, zeros, 32, 4, perm, bias, config)
    expected = wna16_gemm_reference(x, qweight, scales, zeros, 32, 4, perm, bias)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("bits", "act_order"), [(4, True), (8, False)])
def test_dequant_kernel_matches_reference(bits: int, act_order: bool) -> None:
    qweight, scales, zeros, perm = _weights(bits, 48, 64, 32, act_order, seed=1)
    out = wna16_dequantize(qweight, scales, zeros, 32, bits, perm, torch.float32)
    torch.testing.assert_close(
        out, wna16_dequantize_reference(qweight, scales, zeros, 32, bits, perm)
    )


def test_reference_dequantizes_the_documented_layout() -> None:
    # word 0 of column 0 holds values 0..7 for rows 0..7 (value i at bits 4i)
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32)
    w = wna16_dequantize_reference(qweight, torch.ones(1, 1), torch.full((1, 1), 2.0), 8, 4)
    assert w[:, 0].tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_one_row_kinds_reject_token_tiles() -> None:
    with pytest.raises(ValueError, match="fma kernel runs one row per program"):
        GemmConfig("fma", 16, 128, 128, 0, 4, 3)
    with pytest.raises(ValueError, match="kind must be one of"):
        GemmConfig("marlin", 16, 128, 128, 0, 4, 3)


def test_select_config_dispatches_on_tokens_and_fills_the_gpu() -> None:
    # An untuned shape takes the heuristic, by token count.
    decode = select_config(1, 2048, 2048, 128, 4, 132)
    assert decode.kind == "fma" and decode.split_k > 1
    assert select_config(4, 2048, 2048, 128, 4, 132).kind == "sliced_t"
    assert select_config(16, 2048, 2048, 128, 4, 132).kind == "gemm"
    assert select_config(64, 2048, 2048, 128, 4, 132).kind == "gemm_t"
    assert select_config(512, 28672, 4096, 128, 4, 132).kind == "dequant"
    assert select_config(4096, 2048, 2048, 128, 4, 132).kind == "dequant"
    assert select_config(1, 2048, 2048, 32, 4, 132).block_k == 32
    # A tuned shape takes the measured winner of its token bucket, fitted to the group size.
    tuned = TUNED_CONFIGS[(4, 1, 4096, 4096)]
    picked = select_config(1, 4096, 4096, 128, 4, 132)
    assert (picked.kind, picked.block_n) == (tuned.kind, tuned.block_n)
    assert select_config(1, 4096, 4096, 32, 4, 132).block_k == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [({"bits": 3}, "bits must be 4 or 8"), ({"group_size": 48}, "group_size 48 must divide"),
     ({"x": torch.randn(2, 32)}, "x has 32 input features"),
     ({"scales": torch.ones(1, 16)}, r"scales must be float \[2, 16\]"),
     ({"perm": torch.arange(64)}, "perm must be int32")],
)  # fmt: skip
def test_wrapper_rejects_bad_inputs(change: dict, message: str) -> None:
    qweight, scales, zeros, _ = _weights(4, 16, 64, 32, False)
    args = {"x": torch.randn(2, 64), "qweight": qweight, "scales": scales, "zeros": zeros,
            "group_size": 32, "bits": 4, "perm": None} | change  # fmt: skip
    with pytest.raises(ValueError, match=message):
        wna16_gemm(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 16, 64, 300, 1024])
@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, False)])
def test_gpu_dispatch_matches_reference(m: int, bits: int, act_order: bool) -> None:
    k = 512
    qweight, scales, zeros, perm = _weights(bits, 1000, k, 128, act_order)
    args = [t.cuda() if t is not None else None for t in (qweight, scales, zeros, perm)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = wna16_gemm(x, args[0], args[1], args[2], 128, bits, args[3])
    w = wna16_dequantize_reference(args[0], args[1], args[2], 128, bits, args[3])
    expected = x.float() @ w  # [m, 1000] fp32
    # NOTE: bf16 output rounding (half an ulp: 2**-9 relative) plus, on the dequant path, the
    # weight rounded to bf16: per product 2**-9 relative, ~sqrt(K) of them adding up.
    atol = 4 * 2**-9 * k**0.5 * float(w.abs().max())
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "config",
    [GemmConfig("fma", 1, 128, 128, 0, 4, 3), GemmConfig("fma", 1, 256, 64, 16, 8, 2),
     GemmConfig("gemm_t", 16, 128, 128, 0, 4, 3), GemmConfig("gemm_t", 64, 64, 64, 0, 4, 2),
     GemmConfig("sliced_t", 16, 128, 128, 0, 4, 3), GemmConfig("sliced_t", 64, 256, 128, 0, 8, 3),
     GemmConfig("sliced", 16, 128, 128, 0, 4, 3), GemmConfig("sliced", 128, 128, 128, 1, 8, 3),
     GemmConfig("stream", 16, 128, 128, 0, 4, 3), GemmConfig("stream", 16, 256, 128, 8, 8, 4),
     GemmConfig("stream", 64, 64, 128, 0, 4, 2), GemmConfig("stream_pair", 16, 128, 128, 0, 4, 3),
     GemmConfig("stream_pair", 16, 256, 128, 0, 8, 1), GemmConfig("stream_pair", 16, 128, 128, 0, 2, 1),
     GemmConfig("stream_pair", 64, 128, 128, 0, 8, 3)],
    ids=lambda c: f"{c.kind}-{c.block_m}x{c.block_n}x{c.block_k}-split{c.split_k}-w{c.num_warps}",
)  # fmt: skip
@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize(("bits", "act_order", "dtype"), [(4, False, torch.bfloat16),
                                                          (4, True, torch.float16),
                                                          (8, False, torch.bfloat16)])  # fmt: skip
def test_gpu_small_m_kernels_match_reference(
    config: GemmConfig, m: int, bits: int, act_order: bool, dtype: torch.dtype
) -> None:
    k = 1024
    qweight, scales, zeros, perm = _weights(bits, 1000, k, 128, act_order)
    args = [t.cuda() if t is not None else None for t in (qweight, scales, zeros, perm)]
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(1000, device="cuda", dtype=dtype)
    out = wna16_gemm_triton(x, *args[:3], 128, bits, args[3], bias, config)
    w = wna16_dequantize_reference(args[0], args[1], args[2], 128, bits, args[3])
    expected = x.float() @ w + bias.float()  # [m, 1000] fp32
    atol = 4 * 2**-9 * k**0.5 * float(w.abs().max())
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=atol)
