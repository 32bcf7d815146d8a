"""The one linear layer: a pluggable weight method, merged shards, an optional LoRA delta.

A merged layer (QKV, gate-up) concatenates several checkpoint projections along the output
features; `shard_names` keeps their checkpoint names in order (("q_proj", "k_proj", "v_proj")),
so the weight loader and the LoRA layers can address each slice.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from loraplex.quant.base import QuantizationConfig, set_weight_attrs
from loraplex.quant.registry import linear_method_for


class LoRAHook(Protocol):
    """What `adapters` attaches to a linear layer: adds each token's LoRA delta in place."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


class Linear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        shard_names: tuple[str, ...] | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if shard_names is not None and len(shard_names) != len(output_sizes):
            raise ValueError(
                f"{prefix}: {len(shard_names)} shard names for {len(output_sizes)} output sizes"
            )
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.shard_names = shard_names or (prefix.rsplit(".", 1)[-1],)
        self.prefix = prefix
        self.method = linear_method_for(quant_config, prefix)
        self.method.create_weights(self, input_size, self.output_sizes, params_dtype)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.output_size, dtype=params_dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, output_dim=0, output_pack=1)
        else:
            self.register_parameter("bias", None)
        self.lora: LoRAHook | None = None

    def shard_offsets(self) -> list[int]:
        """Start of each shard along the output features, plus the end."""
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        return offsets

    def shard_index(self, shard_name: str) -> int:
        try:
            return self.shard_names.index(shard_name)
        except ValueError:
            raise KeyError(f"{self.prefix} has no shard {shard_name!r}") from None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        """Copy checkpoint tensor `loaded` (shard `shard` of this layer) into `param`."""
        name = _param_name(self, param)
        target = param.data
        if getattr(param, "shard_indexed", False):
            target = target[shard]
        elif getattr(param, "output_dim", None) is not None:
            dim, pack = param.output_dim, getattr(param, "output_pack", 1)
            # NOTE: each shard rounds its own size up to whole packs (128x128 block scales of a
            # 192-wide k_proj take 2 rows), so offsets add up per shard, not over the total.
            sizes = [-(-size // pack) for size in self.output_sizes]
            target = target.narrow(dim, sum(sizes[:shard]), sizes[shard])
        if tuple(target.shape) != tuple(loaded.shape):
            if target.numel() == loaded.numel() == 1:
                loaded = loaded.reshape(target.shape)
            else:
                raise ValueError(
                    f"tensor {self.prefix.rsplit('.', 1)[0]}.{self.shard_names[shard]}.{name} "
                    f"has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}"
                )
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size] -> [num_tokens, output_size]
        out = self.method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora(x, out)
        return out


def _param_name(layer: nn.Module, param: torch.Tensor) -> str:
    for name, p in layer.named_parameters(recurse=False):
        if p is param:
            return name
    return "?"
