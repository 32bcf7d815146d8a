"""Test helpers: a one-block model of merged Linear layers, loaded by the real checkpoint loader."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

from loraplex.platform.models.linear import Linear
from loraplex.platform.models.weight_loader import load_named_weights
from loraplex.quant.base import QuantizationConfig
from loraplex.quant.registry import get_quantization_config

HIDDEN, KV_SIZE, INTER = 128, 64, 256


def proj_shapes(
    kv_size: int = KV_SIZE, hidden: int = HIDDEN, inter: int = INTER
) -> dict[str, tuple[int, int]]:
    """Checkpoint projection -> (N, K); the query size is the hidden size."""
    return {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv_size, hidden),
        "self_attn.v_proj": (kv_size, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


PROJ_SHAPES = proj_shapes()

# merged layer -> its checkpoint projections, in order
MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


class _Block(nn.Module):
    def __init__(
        self, quant: QuantizationConfig | None, kv_size: int, hidden: int, inter: int
    ) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.mlp = nn.Module()
        p = "model.layers.0"
        self.self_attn.qkv_proj = Linear(
            hidden, [hidden, kv_size, kv_size], shard_names=("q_proj", "k_proj", "v_proj"),
            quant_config=quant, prefix=f"{p}.self_attn.qkv_proj",
        )  # fmt: skip
        self.self_attn.o_proj = Linear(
            hidden, [hidden], quant_config=quant, prefix=f"{p}.self_attn.o_proj"
        )
        self.mlp.gate_up_proj = Linear(
            hidden, [inter, inter], shard_names=("gate_proj", "up_proj"),
            quant_config=quant, prefix=f"{p}.mlp.gate_up_proj",
        )  # fmt: skip
        self.mlp.down_proj = Linear(
            inter, [hidden], quant_config=quant, prefix=f"{p}.mlp.down_proj"
        )


class TinyModel(nn.Module):
    """The projections of one decoder layer, named as in a Llama checkpoint (the query size is
    the hidden size)."""

    stacked_shards = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                      "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip

    def __init__(
        self,
        quant: QuantizationConfig | None,
        kv_size: int = KV_SIZE,
        hidden: int = HIDDEN,
        inter: int = INTER,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(quant, kv_size, hidden, inter)])

    def linear(self, merged: str) -> Linear:
        return self.layers[0].get_submodule(merged)


def load_tiny(
    tensors: dict[str, torch.Tensor],
    quant_config: dict[str, Any] | None,
    quantization: str | None = None,
    kv_size: int = KV_SIZE,
    hidden: int = HIDDEN,
    inter: int = INTER,
) -> TinyModel:
    """Build the tiny model for a checkpoint config, load `tensors`, run the repack."""
    quant = get_quantization_config(quantization, quant_config)
    model = TinyModel(quant, kv_size, hidden, inter)
    load_named_weights(model, tensors.items())
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
    return model


def random_weights(
    seed: int = 0, kv_size: int = KV_SIZE, hidden: int = HIDDEN, inter: int = INTER
) -> dict[str, torch.Tensor]:
    """Dense fp32 weights [N, K] per checkpoint projection."""
    gen = torch.Generator().manual_seed(seed)
    shapes = proj_shapes(kv_size, hidden, inter)
    return {
        f"model.layers.0.{name}.weight": torch.randn(n, k, generator=gen) * 0.05
        for name, (n, k) in shapes.items()
    }


def import_autoawq_module(name: str) -> types.ModuleType:
    """Import a module of AutoAWQ without its package __init__ (which needs `datasets`)."""
    if "awq" not in sys.modules:
        spec = importlib.util.find_spec("awq")
        if spec is None or spec.submodule_search_locations is None:
            pytest.skip("autoawq is not installed (pip install --no-deps autoawq)")
        package = types.ModuleType("awq")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["awq"] = package
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"cannot import {name} from autoawq: {exc}")
