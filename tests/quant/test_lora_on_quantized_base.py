"""LoRA on a quantized base: an adapter served on AWQ, GPTQ (act-order) or FP8 layers adds the
same delta as on the dense layers, so a tenant's adapter behaves the same whichever format the
base model is served in; tokens without an adapter get the quantized base alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from quant_tiny_model import HIDDEN, INTER, KV_SIZE, MERGED, load_tiny, random_weights

from loraplex.adapters.lora_layer import attach_lora_layers
from loraplex.adapters.peft_format import BaseModelSpec, load_peft_adapter
from loraplex.config import LoRAConfig
from loraplex.quant.quantize import quantization_config, quantize_awq, quantize_gptq
from tests.tiny_models import tiny_hf_llama, tiny_llama_config

HEADS, KV_HEADS = 4, 2  # head_dim 32: q size = HIDDEN, kv size = KV_SIZE
HF_CONFIG = tiny_llama_config(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                              vocab_size=64)  # fmt: skip
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter (rank 8, non-zero B) for a one-layer Llama of the tiny model's sizes."""
    from peft import LoraConfig, get_peft_model

    assert HIDDEN // HEADS * KV_HEADS == KV_SIZE
    base = tiny_hf_llama(0, **HF_CONFIG)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=ALL_MODULES, init_lora_weights=False)
    folder = tmp_path_factory.mktemp("adapter")
    get_peft_model(base, config).save_pretrained(str(folder))
    return folder


def _checkpoint(fmt: str) -> tuple[dict[str, torch.Tensor], dict | None, str | None]:
    """(tensors, quantization_config, --quantization) of the tiny model in `fmt`."""
    weights = random_weights(seed=3)
    if fmt == "fp8":
        return weights, None, "fp8"
    tensors = {}
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        packed = (
            quantize_awq(weight, 64) if fmt == "awq" else quantize_gptq(weight, 4, 64, False, True)
        )
        tensors.update({f"{module}.{key}": value for key, value in packed.items()})
    return tensors, quantization_config(fmt, 4, 64, False, fmt == "gptq", ""), None


def _with_adapter(model: torch.nn.Module, adapter_folder: Path, slots: torch.Tensor):
    lora = LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    state = attach_lora_layers(model, lora, "cpu", torch.float32, max_num_tokens=16)
    state.load_slot(
        0, load_peft_adapter(adapter_folder, BaseModelSpec.from_hf_config(HF_CONFIG), 8)
    )
    state.meta.set(slots)
    return model


@pytest.mark.parametrize("fmt", ["awq", "gptq", "fp8"])
def test_adapter_adds_the_same_delta_on_a_quantized_base(fmt: str, adapter_folder: Path) -> None:
    tensors, config, quantization = _checkpoint(fmt)
    quantized = load_tiny(tensors, config, quantization)
    bare = load_tiny(tensors, config, quantization)  # the same base, no adapter attached
    dense = load_tiny(random_weights(seed=3), None)
    slots = torch.tensor([0, -1, 0, 0, -1], dtype=torch.int32)  # tokens 1 and 4: base only
    _with_adapter(quantized, adapter_folder, slots)
    _with_adapter(dense, adapter_folder, slots)
    torch.manual_seed(1)
    with torch.no_grad():
        for merged in MERGED:
            x = torch.randn(len(slots), quantized.linear(merged).input_size)
            base = bare.linear(merged)(x)
            delta = quantized.linear(merged)(x) - base
            layer = dense.linear(merged)  # its own base product (an fp32 CPU weight is packed)
            dense_delta = layer(x) - layer.method.apply(layer, x, None)
            assert dense_delta[slots >= 0].abs().max() > 1e-3, merged  # the adapter does act
            torch.testing.assert_close(delta, dense_delta, rtol=1e-4, atol=1e-5)
            assert torch.equal(delta[slots < 0], torch.zeros_like(delta[slots < 0]))
