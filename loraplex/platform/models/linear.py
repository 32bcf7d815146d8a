"""The one linear layer: a pluggable weight method, merged shards, an optional LoRA delta.

A merged layer (QKV, gate-up) concatenates several checkpoint projections along the output
features; `shard_names` keeps their checkpoint names in order (("q_proj", "k_proj", "v_proj")),
so the weight loader and the LoRA layers can address each slice.

Under tensor parallelism a `LinearShard` says which part of the full checkpoint tensors this
rank holds (column-parallel: a range of each projection's outputs; row-parallel: a range of the
inputs); the layer's sizes are then the local ones, the loader reads only its slice of each
checkpoint tensor, and a row-parallel layer sums its partial output (with its LoRA delta) over
the ranks in one all-reduce.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from loraplex.platform.models.checkpoint_tensor import CheckpointTensor, narrow
from loraplex.platform.parallel.parallel_state import SINGLE, TensorParallel
from loraplex.platform.parallel.sharding import LinearShard, Range
from loraplex.quant.base import QuantizationConfig, set_weight_attrs
from loraplex.quant.registry import linear_method_for


class LoRAHook(Protocol):
    """What `adapters` attaches to a linear layer: adds each token's LoRA delta in place."""

    def begin(self, x: torch.Tensor) -> None:
        """Before the base product: start what of the delta needs only `x` (it may run beside
        the product); the call after the product finishes it."""
        ...

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None: ...

    def fused(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's whole output (base product, bias and delta) from one kernel where one
        serves this batch, else None."""
        ...


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
        tp: TensorParallel = SINGLE,
        tp_shard: LinearShard | None = None,
    ) -> None:
        super().__init__()
        if shard_names is not None and len(shard_names) != len(output_sizes):
            raise ValueError(
                f"{prefix}: {len(shard_names)} shard names for {len(output_sizes)} output sizes"
            )
        if tp_shard is not None and len(tp_shard.output_ranges) != len(output_sizes):
            raise ValueError(f"{prefix}: the tensor-parallel shard has the wrong shard count")
        # The full (checkpoint) sizes, and this rank's part of them.
        self.full_input_size = input_size
        self.full_output_sizes = list(output_sizes)
        self.tp = tp
        self.tp_shard = tp_shard if tp.enabled else None
        if self.tp_shard is not None:
            input_size, output_sizes = self.tp_shard.input_size, self.tp_shard.output_sizes
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

    @property
    def row_parallel(self) -> bool:
        return self.tp_shard is not None and self.tp_shard.kind == "row"

    def output_range(self, shard: int) -> Range:
        """Shard `shard`'s output features this rank holds, within its checkpoint projection."""
        if self.tp_shard is None:
            return 0, self.output_sizes[shard]
        return self.tp_shard.output_ranges[shard]

    @property
    def input_range(self) -> Range:
        """The input features this rank holds, within the full input."""
        return self.tp_shard.input_range if self.tp_shard is not None else (0, self.input_size)

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

    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor | CheckpointTensor, shard: int
    ) -> None:
        """Copy checkpoint tensor `loaded` (shard `shard` of this layer) into `param`, reading
        only this rank's slice of it."""
        name = _param_name(self, param)
        loaded = self._rank_slice(param, loaded, shard, name)
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

    def _rank_slice(
        self, param: torch.Tensor, loaded: torch.Tensor | CheckpointTensor, shard: int, name: str
    ) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: its output range along `output_dim`, its
        input range along `input_dim` (both in units of `output_pack` / `input_pack`)."""
        if self.tp_shard is None:
            return narrow(loaded, None, 0, 0)
        cuts = []
        out_dim = getattr(param, "output_dim", None)
        if out_dim is not None and self.tp_shard.kind == "column":
            start, size = self.output_range(shard)
            full = self.full_output_sizes[shard]
            cuts.append((out_dim, start, size, full, getattr(param, "output_pack", 1), "output"))
        in_dim = getattr(param, "input_dim", None)
        if in_dim is not None and self.tp_shard.kind == "row":
            start, size = self.input_range
            full = self.full_input_size
            cuts.append((in_dim, start, size, full, getattr(param, "input_pack", 1), "input"))
        if not cuts:
            return narrow(loaded, None, 0, 0)
        if len(cuts) > 1:
            raise ValueError(f"{self.prefix}.{name}: a layer is split along one dimension")
        dim, start, size, full, pack, what = cuts[0]
        if start % pack or (size % pack and start + size != full):
            raise ValueError(
                f"{self.prefix}.{name}: --tensor-parallel-size {self.tp.size} splits the "
                f"{what} features into slices of {size}, which cut its groups/blocks of {pack}; "
                "use a tensor-parallel size whose slices hold whole groups"
            )
        return narrow(loaded, dim, start // pack, -(-size // pack))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size] -> [num_tokens, output_size]
        if not self.row_parallel:
            if self.lora is not None:
                if (fused := self.lora.fused(self, x)) is not None:
                    return fused
                self.lora.begin(x)
            out = self.method.apply(self, x, self.bias)
            if self.lora is not None:
                self.lora(x, out)
            return out
        # NOTE: each rank's partial product and partial LoRA delta are summed in one
        # all-reduce; the bias is added once, after it.
        full_x = self.tp.all_gather(x) if getattr(self.method, "gathers_input", False) else x
        if self.lora is not None:
            self.lora.begin(x)
        out = self.method.apply(self, full_x, None)
        if self.lora is not None:
            self.lora(x, out)
        self.tp.all_reduce(out)
        if self.bias is not None:
            out += self.bias
        return out


def _param_name(layer: nn.Module, param: torch.Tensor) -> str:
    for name, p in layer.named_parameters(recurse=False):
        if p is param:
            return name
    return "?"
