"""Every W4A16 checkpoint format through the load-time repack and the Triton kernels (interpreter,
small odd sizes) equals the dequantized checkpoint: AWQ "gemm" and GPTQ v1 / v2, with and
without act-order, symmetric and asymmetric, 4 and 8 bits, group 32 / 64 / 128 and per-channel.
The reference dequantizes the checkpoint tensors with the formats' own formulas, written out
here without our packing helpers."""

from __future__ import annotations

import pytest
import torch
from quant_tiny_model import MERGED, load_tiny, random_weights

from loraplex.kernels.w4a16 import w4a16_gemm_triton
from loraplex.kernels.w4a16.types import W4A16Config
from loraplex.quant.quantize import quantization_config, quantize_awq, quantize_gptq

#: AutoAWQ's "gemm" word: column c of a group of 8 sits at nibble position AWQ_POSITION[c].
AWQ_POSITION = (0, 4, 1, 5, 2, 6, 3, 7)
#: The fused kernel (split-K) and the dequantization route; "mma_wscale" differs from "mma" only
#: past the prologue and is covered by tests/kernels/test_w4a16.py.
KINDS = [W4A16Config("mma", 16, 64, 2, 4, 2), W4A16Config("dequant", 16, 64, 1, 4, 1)]


def _nibbles(words: torch.Tensor, bits: int, positions: list[int]) -> torch.Tensor:
    """Value at each of `positions` (one per output element) of the int32 `words`."""
    shifts = torch.tensor(positions, dtype=torch.int64) * bits
    return (words.to(torch.int64) >> shifts) & ((1 << bits) - 1)


def _awq_dense(t: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """[N, K] from AutoAWQ tensors: qweight [K, N / 8], qzeros [G, N / 8], scales [G, N]."""
    n = t["scales"].shape[1]
    column = torch.arange(n)
    positions = [AWQ_POSITION[c % 8] for c in range(n)]
    q = _nibbles(t["qweight"][:, column // 8], 4, positions)  # [K, N]
    zeros = _nibbles(t["qzeros"][:, column // 8], 4, positions)  # [G, N]
    groups = torch.arange(q.shape[0]) // group_size
    return ((q - zeros[groups]) * t["scales"].float()[groups]).t()


def _gptq_dense(t: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """[N, K] from GPTQ tensors: qweight [K / pack, N], qzeros [G, N / pack], scales [G, N],
    g_idx [K]; v1 stores zero - 1."""
    pack = 32 // bits
    k, n = t["g_idx"].shape[0], t["scales"].shape[1]
    row = torch.arange(k)
    q = (t["qweight"][row // pack].to(torch.int64) >> ((row % pack) * bits)[:, None]) & (
        (1 << bits) - 1
    )  # [K, N]
    column = torch.arange(n)
    zeros = _nibbles(t["qzeros"][:, column // pack], bits, [c % pack for c in range(n)])
    zeros = zeros + (1 if v1 else 0)  # [G, N]
    g = t["g_idx"].long()
    return ((q - zeros[g]) * t["scales"].float()[g]).t()


CASES = [
    ("awq", 4, 32, False, False), ("awq", 4, -1, False, False), ("gptq", 4, 32, True, False),
    ("gptq", 4, 64, False, True), ("gptq", 4, 128, True, True), ("gptq", 4, -1, False, False),
    ("gptq", 8, 64, True, True), ("gptq", 8, 128, False, False),
]  # fmt: skip
#: group size -> (hidden, kv, intermediate): odd multiples of the group where one fits.
SIZES = {32: (96, 40, 160), 64: (192, 64, 320), 128: (256, 64, 384), -1: (96, 40, 160)}


@pytest.mark.parametrize(("method", "bits", "group_size", "sym", "act_order"), CASES)
def test_repacked_checkpoint_through_the_kernels_equals_its_formulas(
    method: str, bits: int, group_size: int, sym: bool, act_order: bool
) -> None:
    hidden, kv, inter = SIZES[group_size]
    tensors, dense = {}, {}
    for name, weight in random_weights(bits + group_size, kv, hidden, inter).items():
        module = name.removesuffix(".weight")
        size = weight.shape[1] if group_size == -1 else group_size
        if method == "awq":
            packed = quantize_awq(weight, group_size)
            dense[module] = _awq_dense(packed, size)
        else:
            packed = quantize_gptq(weight, bits, group_size, sym, act_order)
            dense[module] = _gptq_dense(packed, bits, v1=sym)
        tensors.update({f"{module}.{key}": value for key, value in packed.items()})
    config = quantization_config(method, bits, group_size, sym, act_order, "")
    model = load_tiny(tensors, config, kv_size=kv, hidden=hidden, inter=inter)
    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        expected = torch.cat([dense[f"model.layers.0.{p}"] for p in parts])  # [N, K]
        assert (getattr(layer, "perm", None) is not None) == act_order
        x = torch.randn(5, layer.input_size, generator=gen)
        for kind in KINDS:
            out = w4a16_gemm_triton(
                x, layer.qweight, layer.scales, layer.zeros, layer.method.group_size, bits,
                getattr(layer, "perm", None), None, kind,
            )  # fmt: skip
            torch.testing.assert_close(out, x @ expected.t(), rtol=1e-4, atol=1e-4)
