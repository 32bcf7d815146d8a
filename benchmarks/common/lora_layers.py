"""A stack of LoRA layers on the Llama-3.1-8B projection shapes (bf16, rank 16, 64 slots, 32
layers), with the base weights of one layer beside them, for the LoRA kernel benchmarks: cycling
over 32 layers' adapter weights reads them from HBM, as a forward does, not from L2."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.adapters.lora_layer import LoRABatchMeta, LoRALayer
from loraplex.kernels.lora import LoRAStack, lora_expand_ref, lora_shrink_ref

HIDDEN, INTERMEDIATE, Q_SIZE, KV_SIZE = 4096, 14336, 4096, 1024
PROJECTIONS = {  # name: (input size, shard names, shard output sizes)
    "qkv_proj": (HIDDEN, ("q_proj", "k_proj", "v_proj"), [Q_SIZE, KV_SIZE, KV_SIZE]),
    "o_proj": (Q_SIZE, ("o_proj",), [HIDDEN]),
    "gate_up_proj": (HIDDEN, ("gate_proj", "up_proj"), [INTERMEDIATE, INTERMEDIATE]),
    "down_proj": (INTERMEDIATE, ("down_proj",), [HIDDEN]),
}
RANK, MAX_LORAS, NUM_LAYERS = 16, 64, 32
MAX_TOKENS = 256  # the largest batch the LoRA kernel benchmarks run


@dataclass
class _Target:
    """The parts of a base `Linear` that a `LoRALayer` reads."""

    prefix: str
    input_size: int
    output_sizes: list[int]
    shard_names: tuple[str, ...]
    lora: object = None
    bias: torch.Tensor | None = None  # LoRALayer reads it (DoRA's base bias)

    def shard_offsets(self) -> list[int]:
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        return offsets


def reference_delta(layer: LoRALayer, x: torch.Tensor, meta: LoRABatchMeta) -> torch.Tensor:
    """The fp32 torch reference of one projection's delta."""
    w = layer.weights
    w32 = LoRAStack(w.a.float(), w.b_t.float(), w.ranks, w.scaling, w.slice_offsets)
    t = torch.zeros(x.shape[0], w.num_slices * RANK, device=x.device)
    ref = torch.zeros(x.shape[0], w.slice_offsets[-1], device=x.device)
    lora_shrink_ref(x.float(), w32, t, meta.kernel_meta)
    lora_expand_ref(t, w32, ref, meta.kernel_meta)
    return ref


def build_layers(
    device: torch.device, dtype: torch.dtype
) -> tuple[LoRABatchMeta, list[list[LoRALayer]], list[torch.Tensor]]:
    """(batch metadata for up to MAX_TOKENS tokens, NUM_LAYERS lists of one LoRA layer per
    projection with random weights at every slot, the first layer's base weights [N, K])."""
    meta = LoRABatchMeta(MAX_LORAS, RANK, MAX_TOKENS, device)
    layers, weights = [], []
    for index in range(NUM_LAYERS):
        per_layer = []
        for name, (in_size, shards, sizes) in PROJECTIONS.items():
            target = _Target(f"model.layers.{index}.{name}", in_size, sizes, shards)
            layer = LoRALayer(target, index, meta, RANK, device, dtype)
            layer.weights.a.normal_(std=in_size**-0.5)
            layer.weights.b_t.normal_(std=RANK**-0.5)
            layer.weights.ranks.fill_(RANK)
            layer.weights.scaling.fill_(2.0)
            per_layer.append(layer)
            if index == 0:
                weights.append(
                    torch.randn(sum(sizes), in_size, device=device, dtype=dtype) * in_size**-0.5
                )
        layers.append(per_layer)
    return meta, layers, weights
