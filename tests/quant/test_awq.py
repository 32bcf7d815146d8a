"""AWQ "gemm" checkpoints. Independent reference: the `autoawq` package — its
`WQLinear_GEMM.from_linear` packs, its `packing_utils.dequantize_gemm` unpacks."""

from __future__ import annotations

import pytest
import torch
from quant_tiny_model import MERGED, PROJ_SHAPES, import_autoawq_module, load_tiny, random_weights

from loraplex.quant.awq import AWQConfig
from loraplex.quant.quantize import quantization_config, quantize_awq, rtn_quantize

# AutoAWQ dequantizes in fp16, we in fp32: agree to fp16 rounding (a wrong nibble is off by a
# whole quantization step, ~1e-2 here).
FP16_TOL = {"rtol": 2e-3, "atol": 1e-4}


def _awq_reference_checkpoint(group_size: int) -> tuple[dict, dict]:
    """Pack every projection with AutoAWQ itself; return (checkpoint, dense weights [N, K])."""
    gemm = import_autoawq_module("awq.modules.linear.gemm")
    tensors, dense = {}, {}
    for name, weight in random_weights().items():
        module = name.removesuffix(".weight")
        n, k = weight.shape
        size = k if group_size == -1 else group_size
        # Round-to-nearest stands in for AutoAWQ's search of scales and zeros [G, N]; AutoAWQ
        # packs round(w / s + z) unclamped, so it gets the grid weight (q - z) * s.
        q, scales, zeros = rtn_quantize(weight, 4, size, sym=False)
        rows = torch.arange(k) // size
        grid = ((q.t() - zeros[rows]) * scales.float()[rows]).t()  # [N, K]
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = grid
        ref = gemm.WQLinear_GEMM.from_linear(
            linear, 4, size, scales=scales.float(), zeros=zeros.float()
        )
        assert torch.equal(ref.scales, scales)
        tensors.update(
            {f"{module}.{key}": getattr(ref, key) for key in ("qweight", "qzeros", "scales")}
        )
        dense[module] = _autoawq_dequant(ref.qweight, ref.qzeros, ref.scales, size).t()
    return tensors, dense


def _autoawq_dequant(qweight, qzeros, scales, group_size) -> torch.Tensor:
    packing = import_autoawq_module("awq.utils.packing_utils")
    return packing.dequantize_gemm(qweight, qzeros, scales, 4, group_size).float()  # [K, N]


def _merged_reference(dense: dict, merged: str) -> torch.Tensor:
    return torch.cat([dense[f"model.layers.0.{part}"] for part in MERGED[merged]])


@pytest.mark.parametrize("group_size", [32, 64, -1])
def test_loads_autoawq_packed_weights(group_size: int) -> None:
    tensors, dense = _awq_reference_checkpoint(group_size)
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm"}
    model = load_tiny(tensors, config)
    x = torch.randn(5, 256)
    for merged in MERGED:
        layer = model.linear(merged)
        expected = _merged_reference(dense, merged)  # [N, K]
        torch.testing.assert_close(
            layer.method.dequantized_weight(layer).float(), expected, **FP16_TOL
        )
        k = layer.input_size
        torch.testing.assert_close(layer(x[:, :k]), x[:, :k] @ expected.t(), rtol=1e-3, atol=1e-3)


def test_our_quantizer_is_read_by_autoawq() -> None:
    weights = random_weights(seed=1)
    tensors = {}
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        for key, value in quantize_awq(weight, 64).items():
            tensors[f"{module}.{key}"] = value
    model = load_tiny(tensors, quantization_config("awq", 4, 64, False, False, ""))
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        reference = torch.cat(
            [
                _autoawq_dequant(*(tensors[f"model.layers.0.{p}.{key}"] for key in
                                   ("qweight", "qzeros", "scales")), 64).t()
                for p in parts
            ]
        )  # fmt: skip
        torch.testing.assert_close(
            layer.method.dequantized_weight(layer).float(), reference, **FP16_TOL
        )
        original = torch.cat([weights[f"model.layers.0.{p}.weight"] for p in parts])
        # round-to-nearest 4-bit: within half a step of the group's range
        assert (reference - original).abs().max() < 0.2 * original.abs().max()


def test_side_file_keys_of_autoawq() -> None:
    config = AWQConfig.from_config(
        {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
    )
    assert config.group_size == 64


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"version": "gemv"}, "version 'gemv' is not supported"),
        ({"bits": 8}, "bits=8"),
        ({"group_size": 96}, "group_size=96"),
        ({"zero_point": False}, "zero_point"),
    ],
)
def test_unsupported_awq_configs_are_refused(override: dict, message: str) -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", **override}
    with pytest.raises(ValueError, match=message):
        AWQConfig.from_config(config)


def test_malformed_awq_checkpoint_names_the_tensor() -> None:
    tensors = {}
    for name, weight in random_weights().items():
        for key, value in quantize_awq(weight, 64).items():
            tensors[f"{name.removesuffix('.weight')}.{key}"] = value
    config = quantization_config("awq", 4, 64, False, False, "")
    missing = dict(tensors)
    del missing["model.layers.0.self_attn.k_proj.qzeros"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.qzeros"):
        load_tiny(missing, config)
    wrong = dict(tensors)
    wrong["model.layers.0.mlp.up_proj.qweight"] = torch.zeros(
        PROJ_SHAPES["mlp.up_proj"], dtype=torch.int32
    )
    with pytest.raises(ValueError, match=r"mlp\.up_proj\.qweight.*shape"):
        load_tiny(wrong, config)


def test_group_size_must_divide_the_layer_input() -> None:
    method = AWQConfig.from_config({"quant_method": "awq", "group_size": 64}).linear_method(
        "model.layers.0.mlp.down_proj"
    )
    with pytest.raises(ValueError, match="down_proj: AWQ group_size 64 does not divide .* 96"):
        method.create_weights(torch.nn.Module(), 96, [128], torch.float32)
