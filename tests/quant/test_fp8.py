"""FP8 checkpoints. Independent reference: the `compressed-tensors` package — its
`quantize` / `dequantize` for the float-quantized tensors and its config schema."""

from __future__ import annotations

import pytest
import torch
from quant_tiny_model import KV_SIZE, MERGED, load_tiny, random_weights

from loraplex.quant.fp8 import CompressedTensorsConfig, Fp8Config
from loraplex.quant.quantize import quantization_config, quantize_fp8

ct = pytest.importorskip(
    "compressed_tensors", reason="pip install --no-deps compressed-tensors loguru"
)
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402


def _args(strategy: str) -> QuantizationArgs:
    block = [128, 128] if strategy == "block" else None
    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                            block_structure=block)  # fmt: skip


def _ct_dequant(q: torch.Tensor, scale: torch.Tensor, strategy: str) -> torch.Tensor:
    return dequantize(q, scale.float(), None, _args(strategy), dtype=torch.float32)


def _checkpoint(scheme: str, seed: int = 0, kv_size: int = KV_SIZE) -> tuple[dict, dict]:
    weights = random_weights(seed, kv_size)
    tensors = {}
    for name, weight in weights.items():
        for key, value in quantize_fp8(weight, scheme).items():
            tensors[f"{name.removesuffix('.weight')}.{key}"] = value
    return tensors, weights


@pytest.mark.parametrize(
    ("scheme", "strategy", "kv_size"),
    [("per_channel", "channel", KV_SIZE), ("per_tensor", "tensor", KV_SIZE),
     ("block", "block", 128), ("block", "block", KV_SIZE)],
)  # fmt: skip
def test_our_fp8_checkpoints_dequantize_like_compressed_tensors(
    scheme: str, strategy: str, kv_size: int
) -> None:
    tensors, weights = _checkpoint(scheme, kv_size=kv_size)
    config = quantization_config("fp8", 8, 0, True, False, scheme)
    model = load_tiny(tensors, config, kv_size=kv_size)
    scale_key = "weight_scale_inv" if scheme == "block" else "weight_scale"
    x = torch.randn(4, 256)
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        reference = torch.cat([
            _ct_dequant(tensors[f"model.layers.0.{p}.weight"],
                        tensors[f"model.layers.0.{p}.{scale_key}"], strategy)
            for p in parts
        ])  # fmt: skip
        torch.testing.assert_close(layer.method.dequantized_weight(layer), reference)
        original = torch.cat([weights[f"model.layers.0.{p}.weight"] for p in parts])
        assert (reference - original).abs().max() < 0.07 * original.abs().max()
        xk = x[:, : layer.input_size]
        exact = xk @ reference.t()
        # activations quantized per token (or token and block) to e4m3: a few percent
        assert (layer(xk) - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_loads_weights_quantized_by_compressed_tensors(strategy: str) -> None:
    tensors, expected = {}, {}
    for name, weight in random_weights(seed=3).items():
        module = name.removesuffix(".weight")
        dims = 1 if strategy == "channel" else (0, 1)
        scale, zp = calculate_qparams(
            weight.amin(dim=dims, keepdim=strategy == "channel"),
            weight.amax(dim=dims, keepdim=strategy == "channel"),
            _args(strategy),
        )
        q = quantize(weight, scale, zp, _args(strategy), dtype=torch.float8_e4m3fn)
        tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"] = q, scale
        expected[module] = _ct_dequant(q, scale, strategy)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(
            targets=["Linear"], weights=_args(strategy),
            input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token",
                                               dynamic=True, symmetric=True))},
        format="float-quantized", ignore=["lm_head"],
    ).model_dump()  # fmt: skip
    model = load_tiny(tensors, config)
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        reference = torch.cat([expected[f"model.layers.0.{p}"] for p in parts])
        torch.testing.assert_close(layer.method.dequantized_weight(layer), reference)


def test_written_config_is_valid_for_compressed_tensors() -> None:
    config = quantization_config("fp8", 8, 0, True, False, "per_channel")
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.config_groups["group_0"].weights.strategy == "channel"
    assert parsed.config_groups["group_0"].input_activations.dynamic is True


def test_online_fp8_quantizes_a_dense_checkpoint_at_load() -> None:
    weights = random_weights(seed=4)
    model = load_tiny(weights, None, quantization="fp8")
    layer = model.linear("self_attn.qkv_proj")
    assert layer.weight.dtype == torch.float8_e4m3fn
    dense = torch.cat([weights[f"model.layers.0.{p}.weight"] for p in MERGED["self_attn.qkv_proj"]])
    x = torch.randn(6, 128)
    assert (layer(x) - x @ dense.t()).abs().max() < 0.06 * (x @ dense.t()).abs().max()


def test_static_input_scale_per_tensor() -> None:
    tensors, _ = _checkpoint("per_tensor")
    for name in list(tensors):
        if name.endswith(".weight_scale"):
            tensors[name.replace("weight_scale", "input_scale")] = torch.tensor([0.02])
    config = quantization_config("fp8", 8, 0, True, False, "per_tensor")
    config["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    model = load_tiny(tensors, config)
    layer = model.linear("mlp.down_proj")
    x = torch.randn(3, 256)
    exact = x @ layer.method.dequantized_weight(layer).t()
    assert (layer(x) - exact).abs().max() < 0.05 * exact.abs().max()


@pytest.mark.parametrize(
    ("cls", "config", "message"),
    [
        (
            CompressedTensorsConfig,
            {"format": "pack-quantized"},
            "'pack-quantized' is not supported",
        ),
        (Fp8Config, {"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        (
            Fp8Config,
            {"quant_method": "fp8", "weight_block_size": [128, 96]},
            r"block size \[128, 96\]",
        ),
    ],
)
def test_unsupported_fp8_configs_are_refused(cls, config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls.from_config(config)


def test_int8_compressed_tensors_is_refused() -> None:
    config = quantization_config("fp8", 8, 0, True, False, "per_channel")
    config["config_groups"]["group_0"]["weights"]["type"] = "int"
    with pytest.raises(ValueError, match="only 8-bit float quantization"):
        CompressedTensorsConfig.from_config(config)


def test_malformed_fp8_checkpoint_names_the_tensor() -> None:
    tensors, _ = _checkpoint("block", kv_size=128)
    config = quantization_config("fp8", 8, 0, True, False, "block")
    wrong = dict(tensors)
    wrong["model.layers.0.mlp.gate_proj.weight_scale_inv"] = torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight_scale_inv has shape \(2, 2\)"):
        load_tiny(wrong, config, kv_size=128)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.self_attn.o_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
        load_tiny(missing, config, kv_size=128)
