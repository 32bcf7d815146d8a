"""LoRA layers: per-slot adapter weights beside each linear layer, applied by slot per token.

Every adapted `Linear` gets a `LoRALayer` as its `lora` hook. For each shard (q/k/v of a merged
QKV, gate/up of gate-up, or the single o/down projection) it keeps stacked slot weights padded
to `max_lora_rank`: `A [max_loras, max_rank, in]` and `B^T [max_loras, max_rank, out_shard]`,
plus each slot's used rank and scaling. Mixed ranks: a slot holding a rank-8 adapter copies and
computes only its first 8 rows (the kernels stop at `ranks[slot]`); only the memory is reserved
at the maximum, so any slot can take any adapter and loads never fragment.

One `LoRABatchMeta`, shared by all layers, holds the step's per-token slots in persistent
buffers (stable addresses, so CUDA graphs captured over them replay with new contents).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from loraplex.adapters.peft_format import SUPPORTED_MODULES, BaseModelSpec, LoRAWeights
from loraplex.config import LoRAConfig
from loraplex.kernels.lora import LoRAKernelMeta, lora_expand, lora_kernel_meta, lora_shrink

_LAYER_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.\w+$")


class LoRATarget(Protocol):
    """What a linear layer exposes to be adapted (see `loraplex.platform.models.linear`)."""

    prefix: str
    input_size: int
    output_sizes: list[int]
    shard_names: tuple[str, ...]
    lora: object

    def shard_offsets(self) -> list[int]: ...


class LoRABatchMeta:
    """The current step's per-token adapter slots, set once per step before the forward."""

    def __init__(
        self, num_slots: int, max_rank: int, max_num_tokens: int, device: torch.device
    ) -> None:
        self.num_slots = num_slots
        self.max_num_tokens = max_num_tokens
        self.active = False
        self._slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self._order = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self._start = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self._count = torch.zeros(num_slots, dtype=torch.int32, device=device)
        # shrink output, reused by every layer and shard in turn
        self.workspace = torch.zeros(
            max_num_tokens, max_rank, dtype=torch.float32, device=device
        )  # [max_num_tokens, max_rank]
        self.kernel_meta = self._view(0)

    def _view(self, n: int) -> LoRAKernelMeta:
        return LoRAKernelMeta(self._slots[:n], self._order[:n], self._start, self._count)

    def set(self, lora_slots: torch.Tensor, *, always_apply: bool = False) -> None:
        """Install a step's slots (`[num_tokens]` int32, -1 = base) into the shared buffers.

        A CPU tensor with no adapter token switches the LoRA layers off for the step. During
        CUDA-graph capture pass `always_apply=True`, so the kernels are recorded."""
        n = lora_slots.shape[0]
        if n > self.max_num_tokens:
            raise ValueError(f"{n} tokens in a step, LoRA buffers hold {self.max_num_tokens}")
        on_host = lora_slots.device.type == "cpu"
        self.active = always_apply or not on_host or bool((lora_slots >= 0).any())
        meta = lora_kernel_meta(lora_slots.to(self._slots.device), self.num_slots)
        self._slots[:n].copy_(meta.lora_slots)
        self._order[:n].copy_(meta.token_order)
        self._start.copy_(meta.slot_start)
        self._count.copy_(meta.slot_count)
        self.kernel_meta = self._view(n)


class LoRALayer:
    """The `LoRAHook` of one linear layer: adds each token's adapter delta into `out`."""

    def __init__(
        self,
        target: LoRATarget,
        layer_index: int,
        meta: LoRABatchMeta,
        max_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.prefix = target.prefix
        self.layer_index = layer_index
        self.shard_names = tuple(target.shard_names)
        self.input_size = target.input_size
        self.output_sizes = list(target.output_sizes)
        self.offsets = target.shard_offsets()
        self.meta = meta
        slots, shards = meta.num_slots, len(self.shard_names)
        self.a = [
            torch.zeros(slots, max_rank, self.input_size, dtype=dtype, device=device)
            for _ in self.shard_names
        ]  # each [max_loras, max_rank, in]
        self.b_t = [
            torch.zeros(slots, max_rank, n, dtype=dtype, device=device) for n in self.output_sizes
        ]  # each [max_loras, max_rank, out_shard]
        self.ranks = torch.zeros(shards, slots, dtype=torch.int32, device=device)
        self.scaling = torch.zeros(shards, slots, dtype=torch.float32, device=device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # x: [num_tokens, in], out: [num_tokens, sum(output_sizes)]
        if not self.meta.active:
            return
        meta, t = self.meta.kernel_meta, self.meta.workspace
        for i in range(len(self.shard_names)):
            lora_shrink(x, self.a[i], t, meta, self.ranks[i])
            lora_expand(t, self.b_t[i], out, self.offsets[i], meta, self.ranks[i], self.scaling[i])

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Copy this layer's modules of `weights` into `slot` (non-blocking from pinned memory);
        shards the adapter does not touch get rank 0."""
        for i, name in enumerate(self.shard_names):
            module = weights.modules.get((self.layer_index, name))
            if module is None:
                self.ranks[i, slot] = 0
                continue
            r = module.rank
            self.a[i][slot, :r].copy_(module.a, non_blocking=True)
            self.b_t[i][slot, :r].copy_(module.b.T, non_blocking=True)
            self.ranks[i, slot] = r
            self.scaling[i, slot] = module.scaling


@dataclass(frozen=True)
class LoRAModelState:
    """All LoRA layers of one model and the batch metadata they share."""

    meta: LoRABatchMeta
    layers: tuple[LoRALayer, ...]

    def load_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Write an adapter into `slot` of every layer (on the caller's current stream)."""
        for layer in self.layers:
            layer.load_slot(slot, weights)

    def check_spec(self, spec: BaseModelSpec) -> None:
        """Raise `ValueError` if the attached layers disagree with the adapters' base spec."""
        for layer in self.layers:
            if layer.layer_index >= spec.num_layers:
                raise ValueError(
                    f"{layer.prefix}: layer {layer.layer_index} is beyond the "
                    f"spec's {spec.num_layers} layers"
                )
            for name, out in zip(layer.shard_names, layer.output_sizes):
                if spec.module_shape(name) != (layer.input_size, out):
                    raise ValueError(
                        f"{layer.prefix}.{name}: shape {(layer.input_size, out)} "
                        f"differs from the spec's {spec.module_shape(name)}"
                    )


def attach_lora_layers(
    model: nn.Module,
    lora_config: LoRAConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    max_num_tokens: int = 8192,
) -> LoRAModelState:
    """Give every decoder-layer projection of `model` a `LoRALayer` hook.

    Adapted layers are modules with a `prefix` like `model.layers.3.self_attn.qkv_proj` whose
    `shard_names` are all LoRA-capable projections (q/k/v/o/gate/up/down)."""
    device = torch.device(device)
    meta = LoRABatchMeta(lora_config.max_loras, lora_config.max_lora_rank, max_num_tokens, device)
    layers = []
    for module in model.modules():
        prefix = getattr(module, "prefix", None)
        shards = getattr(module, "shard_names", None)
        if not isinstance(prefix, str) or shards is None or not hasattr(module, "lora"):
            continue
        match = _LAYER_PREFIX.search(prefix)
        if match is None or not set(shards) <= set(SUPPORTED_MODULES):
            continue
        layer = LoRALayer(module, int(match[1]), meta, lora_config.max_lora_rank, device, dtype)
        module.lora = layer
        layers.append(layer)
    if not layers:
        raise ValueError("attach_lora_layers: the model has no q/k/v/o/gate/up/down projections")
    return LoRAModelState(meta, tuple(layers))
