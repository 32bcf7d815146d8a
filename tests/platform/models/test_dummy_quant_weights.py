"""Random weights for quantized architectures: a config.json holding a `quantization_config`
builds the quantized model with random checkpoint-format tensors, processed as a real
checkpoint is; the engine serves it, the same seed gives the same model, and the dequantized
weights have the scale of the dense random ones (std 0.02)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from loraplex import LLM, SamplingParams
from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.models.dummy_weights import hf_state_dict, init_random_weights
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.model_loader import build_model, finish_loading, load_model
from loraplex.quant import registry
from loraplex.quant.base import LinearMethod, QuantizationConfig
from loraplex.quant.registry import get_quantization_config
from loraplex.quant.unquantized import UnquantizedLinearMethod
from tests.tiny_models import tiny_llama_config

REPO = Path(__file__).resolve().parents[3]
# Llama-3 shape at toy size: GQA, K of 128 and 256, groups of 64
TINY = tiny_llama_config(hidden_size=128, intermediate_size=256, rope_theta=500000.0)
QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True},
    "gptq-8bit-v2": {"quant_method": "gptq", "bits": 8, "group_size": -1,
                     "checkpoint_format": "gptq_v2"},
    "fp8-compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                  "strategy": "token"},
        }},
    },
}  # fmt: skip
METHOD_NAMES = {"awq": "awq", "fp8-compressed-tensors": "fp8"}


def _write_config(tmp_path: Path, quant: dict[str, Any] | None) -> Path:
    cfg = dict(TINY)
    if quant is not None:
        cfg["quantization_config"] = quant
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _load(path: Path, seed: int, quantization: str | None = None) -> nn.Module:
    model, _, _ = load_model(path, "float32", torch.device("cpu"), quantization, random_seed=seed)
    return model


def _linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("fmt", [*QUANT_CONFIGS, "fp8-at-load"])
def test_random_quantized_model_serves_finite_logprobs(fmt: str, tmp_path: Path) -> None:
    at_load = fmt == "fp8-at-load"
    path = _write_config(tmp_path, None if at_load else QUANT_CONFIGS[fmt])
    llm = LLM(
        str(path), dtype="float32", device="cpu", num_kv_blocks=64, seed=3, enable_lora=False,
        quantization="fp8" if at_load else None,
    )  # fmt: skip
    methods = {layer.method.name for layer in _linears(llm.engine.runner.model)}
    assert methods == {METHOD_NAMES.get(fmt, fmt.split("-")[0])}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = llm.generate([[5, 17, 42, 99, 3], [7] * 20], params)
    for out in outs:
        completion = out.outputs[0]
        assert len(completion.token_ids) == 6
        assert completion.cumulative_logprob is not None
        assert math.isfinite(completion.cumulative_logprob)
        for step in completion.logprobs or []:
            assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in step.values())


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "gptq-8bit-v2"])
def test_random_quantized_weights_are_deterministic_per_seed(fmt: str, tmp_path: Path) -> None:
    path = _write_config(tmp_path, QUANT_CONFIGS[fmt])
    first, again, other = _load(path, 7), _load(path, 7), _load(path, 8)
    for a, b, c in zip(_linears(first), _linears(again), _linears(other)):
        w_a, w_b = a.method.dequantized_weight(a), b.method.dequantized_weight(b)
        assert torch.equal(w_a, w_b), a.prefix
        assert not torch.equal(w_a, c.method.dequantized_weight(c)), a.prefix
    assert torch.equal(first.embed_tokens, again.embed_tokens)


@pytest.mark.parametrize("fmt", [*QUANT_CONFIGS, "fp8-at-load", "dense"])
def test_dequantized_random_weights_have_the_dense_scale(fmt: str, tmp_path: Path) -> None:
    at_load = fmt == "fp8-at-load"
    path = _write_config(tmp_path, QUANT_CONFIGS.get(fmt))
    model = _load(path, 0, "fp8" if at_load else None)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    for layer in _linears(model):
        w = layer.method.dequantized_weight(layer).float()  # [N, K]
        assert tuple(w.shape) == (layer.output_size, layer.input_size)
        assert w.std().item() == pytest.approx(0.02, rel=0.1), layer.prefix
        assert abs(w.mean().item()) < 0.002, layer.prefix
        # every output feature of every shard is random, none left empty
        assert (w.abs().amax(dim=1) > 0).all(), layer.prefix


def test_llama_8b_awq_config_builds_awq_layers_of_the_8b_shapes() -> None:
    cfg = json.loads((REPO / "configs/models/llama-3.1-8b-awq.json").read_text())
    dense = json.loads((REPO / "configs/models/llama-3.1-8b.json").read_text())
    assert {k: v for k, v in cfg.items() if k not in ("quantization_config", "torch_dtype")} == {
        k: v for k, v in dense.items() if k != "torch_dtype"
    }
    arch = ArchConfig.from_dict(cfg)
    quant = get_quantization_config(None, cfg["quantization_config"])
    model = build_model(arch, torch.float16, torch.device("meta"), quant)
    layers = _linears(model)
    assert len(layers) == 4 * arch.num_layers
    assert {layer.method.name for layer in layers} == {"awq"}
    assert {layer.method.group_size for layer in layers} == {128}
    shapes = {(layer.output_size, layer.input_size) for layer in layers}
    assert shapes == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}


def test_checkpoint_format_named_by_quantization_flag_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--quantization awq names a checkpoint format"):
        _load(_write_config(tmp_path, None), 0, "awq")


def test_flag_disagreeing_with_the_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="checkpoint is quantized with awq"):
        _load(_write_config(tmp_path, QUANT_CONFIGS["awq"]), 0, "gptq")


def test_unsupported_quantization_setting_is_refused(tmp_path: Path) -> None:
    quant = {**QUANT_CONFIGS["awq"], "bits": 3}
    with pytest.raises(ValueError, match="AWQ bits=3 is not supported"):
        _load(_write_config(tmp_path, quant), 0)


class _OpaqueMethod(UnquantizedLinearMethod):
    name = "opaque"


class _OpaqueConfig(QuantizationConfig):
    names = ("opaque",)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _OpaqueConfig:
        return cls()

    def linear_method(self, prefix: str) -> LinearMethod:
        return _OpaqueMethod()


def test_method_without_random_fill_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry._load_builtin()
    monkeypatch.setitem(registry._REGISTRY, "opaque", _OpaqueConfig)
    with pytest.raises(ValueError, match="random weights for opaque layers are not supported"):
        _load(_write_config(tmp_path, {"quant_method": "opaque"}), 0)


def test_hf_state_dict_refuses_a_quantized_model(tmp_path: Path) -> None:
    model = _load(_write_config(tmp_path, QUANT_CONFIGS["awq"]), 0)
    with pytest.raises(ValueError, match="hf_state_dict needs an unquantized model"):
        hf_state_dict(model)


LLAMA_8B_LINEARS = {  # prefix -> (input size, output sizes)
    "model.layers.0.self_attn.qkv_proj": (4096, [4096, 1024, 1024]),
    "model.layers.0.self_attn.o_proj": (4096, [4096]),
    "model.layers.0.mlp.gate_up_proj": (4096, [14336, 14336]),
    "model.layers.0.mlp.down_proj": (14336, [4096]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order"])
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_random_8b_layers_run_the_kernels_like_the_reference(fmt: str, tokens: int) -> None:
    """Random checkpoint-format weights, repacked at load, give the kernels' output the
    dequantized weight predicts, on the Llama-3.1-8B shapes with groups of 128."""
    quant = get_quantization_config(None, {**QUANT_CONFIGS[fmt], "group_size": 128})
    with torch.device("cuda"):
        layers = nn.ModuleList(
            Linear(k, sizes, quant_config=quant, prefix=prefix, params_dtype=torch.float16)
            for prefix, (k, sizes) in LLAMA_8B_LINEARS.items()
        )
    init_random_weights(layers, seed=0)
    finish_loading(layers)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for layer in layers:
        x = torch.randn(tokens, layer.input_size, generator=gen, device="cuda")  # [M, K]
        out = layer(x.half()).float()  # [M, N]
        ref = x.half().float() @ layer.method.dequantized_weight(layer).float().t()
        err = (out - ref).norm() / ref.norm()
        assert err.item() < 1e-2, (layer.prefix, tokens, err.item())
