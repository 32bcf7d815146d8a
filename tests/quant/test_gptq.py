"""GPTQ checkpoints. Independent reference: the formulas of AutoGPTQ's torch path, written out
below without our packing helpers — `QuantLinear.pack` (qlinear_cuda_old: intweight =
round(W / scale) + zero, packed along K; zeros - 1 packed along N) and its forward (unpack with
`(qweight >> wf) & maxq`, `zeros + 1` for the v1 format, W = scales[g_idx] * (W_int -
zeros[g_idx]))."""

from __future__ import annotations

import pytest
import torch
from quant_tiny_model import MERGED, load_tiny, random_weights

from loraplex.quant.gptq import GPTQConfig
from loraplex.quant.quantize import quantization_config, quantize_gptq


def _ref_pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ-style: pack along dim 0, value j of a word at bits*j."""
    pack = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0] // pack, pack, -1)
    words = sum(v[:, j] << (bits * j) for j in range(pack)) & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _ref_dequant(qweight, qzeros, scales, g_idx, bits, v1: bool) -> torch.Tensor:
    """AutoGPTQ torch forward's dequantization -> W [N, K]."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = (qzeros.unsqueeze(2) >> wf.view(1, 1, -1)) & (2**bits - 1)
    zeros = zeros.reshape(scales.shape) + (1 if v1 else 0)
    weight = (qweight.unsqueeze(1) >> wf.view(1, -1, 1)) & (2**bits - 1)
    weight = weight.reshape(-1, qweight.shape[1])
    g = g_idx.long()
    return (scales.float()[g] * (weight - zeros[g]).float()).t()


def _ref_checkpoint(bits: int, group_size: int, act_order: bool, v1: bool, seed: int = 0):
    """Random integer weights packed by the reference; (tensors, dense [N, K] per module)."""
    gen = torch.Generator().manual_seed(seed)
    maxq = 2**bits - 1
    tensors, dense = {}, {}
    for name, weight in random_weights(seed).items():
        module = name.removesuffix(".weight")
        n, k = weight.shape
        size = k if group_size == -1 else group_size
        groups = k // size
        g_idx = torch.arange(k, dtype=torch.int32) // size
        if act_order:  # one shared permutation per input, as GPTQ's Hessian order gives
            g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(k))]
        intweight = torch.randint(0, maxq + 1, (k, n), generator=gen)
        zeros = torch.randint(1 if v1 else 0, maxq + 1, (groups, n), generator=gen)
        scales = (torch.rand(groups, n, generator=gen) * 0.01 + 1e-3).half()
        stored = (zeros - 1) if v1 else zeros
        qzeros = _ref_pack_rows(stored.t().contiguous(), bits).t().contiguous()
        tensors.update(
            {f"{module}.qweight": _ref_pack_rows(intweight, bits), f"{module}.qzeros": qzeros,
             f"{module}.scales": scales, f"{module}.g_idx": g_idx}
        )  # fmt: skip
        dense[module] = _ref_dequant(tensors[f"{module}.qweight"], qzeros, scales, g_idx, bits, v1)
    return tensors, dense


@pytest.mark.parametrize(
    ("bits", "group_size", "act_order", "v1"),
    [(4, 32, False, True), (4, -1, False, False), (4, 64, True, True), (8, 32, True, False),
     (8, -1, False, True)],
)  # fmt: skip
def test_gptq_matches_autogptq_formulas(bits: int, group_size: int, act_order: bool, v1: bool):
    tensors, dense = _ref_checkpoint(bits, group_size, act_order, v1)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
              "desc_act": act_order, "sym": False,
              "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip
    model = load_tiny(tensors, config)
    x = torch.randn(3, 256)
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        expected = torch.cat([dense[f"model.layers.0.{p}"] for p in parts])  # [N, K]
        torch.testing.assert_close(layer.method.dequantized_weight(layer), expected)
        assert (getattr(layer, "perm", None) is not None) == act_order
        xk = x[:, : layer.input_size]
        torch.testing.assert_close(layer(xk), xk @ expected.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("sym", "desc_act", "bits"), [(True, False, 4), (False, True, 4), (True, True, 8)]
)
def test_our_quantizer_is_read_by_the_autogptq_formulas(sym: bool, desc_act: bool, bits: int):
    weights = random_weights(seed=2)
    tensors = {}
    for name, weight in weights.items():
        for key, value in quantize_gptq(weight, bits, 32, sym, desc_act).items():
            tensors[f"{name.removesuffix('.weight')}.{key}"] = value
    config = quantization_config("gptq", bits, 32, sym, desc_act, "")
    assert config["checkpoint_format"] == ("gptq" if sym else "gptq_v2")
    model = load_tiny(tensors, config)
    for merged, parts in MERGED.items():
        layer = model.linear(merged)
        reference = torch.cat([
            _ref_dequant(*(tensors[f"model.layers.0.{p}.{key}"] for key in
                           ("qweight", "qzeros", "scales", "g_idx")), bits, sym)
            for p in parts
        ])  # fmt: skip
        torch.testing.assert_close(layer.method.dequantized_weight(layer), reference)
        original = torch.cat([weights[f"model.layers.0.{p}.weight"] for p in parts])
        step = 2.0 / (2**bits - 1)  # of the group's range
        assert (reference - original).abs().max() < step * original.abs().max()


@pytest.mark.parametrize(
    ("override", "message"),
    [({"bits": 3}, "bits=3"), ({"group_size": 100}, "group_size=100"),
     ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
     ({"is_marlin_format": True}, "Marlin")],
)  # fmt: skip
def test_unsupported_gptq_configs_are_refused(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTQConfig.from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, **override})


def test_malformed_gptq_checkpoints_name_the_tensor() -> None:
    tensors, _ = _ref_checkpoint(4, 32, act_order=True, v1=True)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.up_proj.g_idx"}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.g_idx"):
        load_tiny(missing, config)
    wrong = dict(tensors)
    wrong["model.layers.0.self_attn.v_proj.scales"] = torch.ones(4, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"self_attn\.v_proj\.scales has shape \(4, 32\)"):
        load_tiny(wrong, config)
    disagree = dict(tensors)
    disagree["model.layers.0.self_attn.k_proj.g_idx"] = torch.arange(128, dtype=torch.int32) // 32
    with pytest.raises(ValueError, match=r"qkv_proj\.g_idx: the merged shards disagree"):
        load_tiny(disagree, config)


def test_g_idx_may_be_left_out_without_act_order() -> None:
    tensors, dense = _ref_checkpoint(4, 32, act_order=False, v1=True)
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".g_idx")}
    model = load_tiny(tensors, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    layer = model.linear("mlp.down_proj")
    torch.testing.assert_close(
        layer.method.dequantized_weight(layer), dense["model.layers.0.mlp.down_proj"]
    )
