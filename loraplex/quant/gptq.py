"""GPTQ checkpoints: 4 or 8 bits, any group size (or -1), act-order, v1 and v2 zero points.

Per linear layer with input size K, output size N, pack = 32 // bits, G groups:
- `qweight` [K / pack, N] int32, packed along K in plain order;
- `qzeros` [G, N / pack] int32, packed along N; checkpoint_format "gptq" (v1) stores the zero
  point minus one, "gptq_v2" stores it as is;
- `scales` [G, N] fp16;
- `g_idx` [K] int32: the group of each input feature (act-order shuffles them).
weight[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].
At load, act-order rows are sorted by group (so groups are contiguous for the kernel) and the
permutation is kept to gather the activations; see `loraplex.quant.wna16`.

Tensor parallelism: a column-parallel layer keeps the whole input (act-order included) and a
slice of the outputs. A row-parallel layer without act-order keeps whole groups of its inputs.
A row-parallel act-order layer cannot: its rank's inputs (whole heads, a slice of the MLP)
belong to any group. It is loaded whole, sorted by group, and each rank keeps whole groups
of the *sorted* rows; its input is all-gathered before the layer and each rank gathers the
features of its rows (`gathers_input`: one all-gather more per such layer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraplex.quant.base import LinearMethod, QuantizationConfig, set_weight_attrs
from loraplex.quant.packing import SUPPORTED_BITS, pack_factor, unpack_int32
from loraplex.quant.registry import register_quantization
from loraplex.quant.wna16 import (
    WNA16LinearMethod,
    check_output_sizes,
    resolve_group_size,
)

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@register_quantization
class GPTQConfig(QuantizationConfig):
    """`quant_method: "gptq"`, or AutoGPTQ's / GPTQModel's quantize_config.json."""

    names = ("gptq",)

    def __init__(self, bits: int, group_size: int, desc_act: bool, checkpoint_format: str) -> None:
        self.bits = bits
        self.group_size = group_size
        self.desc_act = desc_act
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits = int(config.get("bits", 4))
        group_size = int(config.get("group_size", 128))
        checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"GPTQ bits={bits} is not supported; supported: {SUPPORTED_BITS}")
        if group_size != -1 and (group_size <= 0 or group_size % 16):
            raise ValueError(
                f"GPTQ group_size={group_size} is not supported; use -1 or a multiple of 16"
            )
        if config.get("is_marlin_format"):
            raise ValueError("GPTQ checkpoints in Marlin format are not supported")
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; "
                f"supported: {CHECKPOINT_FORMATS}"
            )
        if config.get("dynamic"):
            raise ValueError("GPTQ per-module 'dynamic' overrides are not supported")
        return cls(bits, group_size, bool(config.get("desc_act", False)), checkpoint_format)

    def linear_method(self, prefix: str) -> LinearMethod:
        return GPTQLinearMethod(prefix, self)


class GPTQLinearMethod(WNA16LinearMethod):
    name = "gptq"

    def __init__(self, prefix: str, config: GPTQConfig) -> None:
        super().__init__(prefix, bits=config.bits)
        self.config = config
        # Row-parallel layers: (rank, size, this rank's first input feature); see the module doc.
        self.row_split: tuple[int, int, int] | None = None
        self.gathers_input = False

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        pack = pack_factor(self.bits)
        check_output_sizes(self.prefix, "GPTQ", output_sizes, pack)
        shard = getattr(layer, "tp_shard", None)
        if shard is not None and shard.kind == "row":
            tp = layer.tp
            self.row_split = (tp.rank, tp.size, shard.input_range[0])
            self.gathers_input = self.config.desc_act and self.config.group_size != -1
            if self.gathers_input:
                input_size = layer.full_input_size  # loaded whole, split after sorting
        if input_size % pack:
            raise ValueError(
                f"{self.prefix}: GPTQ packs {pack} inputs per int32 word, "
                f"but the input size is {input_size}"
            )
        self.group_size = resolve_group_size(
            self.prefix, "GPTQ", self.config.group_size, input_size
        )
        self.params_dtype = params_dtype
        n, groups = sum(output_sizes), input_size // self.group_size
        qweight = torch.empty(input_size // pack, n, dtype=torch.int32)
        qzeros = torch.empty(groups, n // pack, dtype=torch.int32)
        scales = torch.empty(groups, n, dtype=torch.float16)
        # NOTE: one g_idx row per shard: merged q/k/v (or gate/up) each bring their own. It
        # starts as the plain order, so a checkpoint without act-order may leave it out.
        g_idx = (torch.arange(input_size, dtype=torch.int32) // self.group_size).repeat(
            len(output_sizes), 1
        )
        # NOTE: `input_dim` is read only by a row-parallel rank that keeps a slice of the inputs.
        split = self.row_split is not None and not self.gathers_input
        group_dim = 0 if split and self.config.group_size != -1 else None
        k_dim = 0 if split else None
        params = {
            "qweight": (qweight, {"output_dim": 1, "output_pack": 1, "input_dim": k_dim,
                                  "input_pack": pack}),
            "qzeros": (qzeros, {"output_dim": 1, "output_pack": pack, "input_dim": group_dim,
                                "input_pack": self.group_size}),
            "scales": (scales, {"output_dim": 1, "output_pack": 1, "input_dim": group_dim,
                                "input_pack": self.group_size}),
            "g_idx": (
                g_idx,
                {"output_dim": None, "shard_indexed": True, "optional": not self.config.desc_act,
                 "input_dim": k_dim, "input_pack": 1},
            ),
        }  # fmt: skip
        for name, (tensor, attrs) in params.items():
            param = nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, **attrs)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        bits, group_size = self.bits, self.group_size
        zeros = unpack_int32(layer.qzeros.data, bits, dim=1).float()  # [G, N]
        if self.config.checkpoint_format == "gptq":
            # NOTE: v1 stores zero - 1 (AutoGPTQ's convention); the stored value is read
            # through the bit mask before the + 1, as AutoGPTQ's own kernels do.
            zeros = zeros + 1
        g_idx = layer.g_idx.data
        if self.row_split is not None and not self.gathers_input and self.config.group_size != -1:
            # NOTE: a row-parallel rank's slice of a plain g_idx names global groups.
            g_idx = g_idx - self.row_split[2] // group_size
        g_idx = self._shared_g_idx(g_idx, zeros.shape[0])  # [K]
        values = unpack_int32(layer.qweight.data, bits, dim=0)  # [K, N]
        scales = layer.scales.data  # [G, N]
        perm = None
        k = g_idx.shape[0]
        sequential = torch.arange(k, device=g_idx.device, dtype=torch.int32) // group_size
        if not torch.equal(g_idx, sequential):
            order = torch.sort(g_idx, stable=True).indices
            if not torch.equal(g_idx[order], sequential):
                raise ValueError(
                    f"{self.prefix}.g_idx: every group must hold exactly {group_size} inputs"
                )
            values = values[order]  # rows sorted by group
            perm = order.to(torch.int32)
        if self.gathers_input:
            values, scales, zeros, perm = self._keep_sorted_groups(values, scales, zeros, perm)
            layer.register_buffer("input_index", perm.long())  # [K / tp] features of its rows
            perm = None
        self.finish_wna16(layer, values, scales, zeros.to(torch.float16), perm)

    def _keep_sorted_groups(
        self,
        values: torch.Tensor,  # [K, N], rows sorted by group
        scales: torch.Tensor,  # [G, N]
        zeros: torch.Tensor,  # [G, N]
        perm: torch.Tensor | None,  # [K] int32: the input feature of each sorted row
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A row-parallel act-order rank's whole groups [r * G / tp, (r + 1) * G / tp) of the
        sorted rows, and the input feature each of its rows multiplies."""
        rank, size, _ = self.row_split  # type: ignore[misc]
        groups = scales.shape[0]
        if groups % size:
            raise ValueError(
                f"{self.prefix}: --tensor-parallel-size {size} does not divide its {groups} "
                f"act-order groups of {self.group_size} inputs; use a size that divides {groups}"
            )
        per_rank = groups // size
        k = values.shape[0]
        if perm is None:
            perm = torch.arange(k, dtype=torch.int32, device=values.device)
        g0 = rank * per_rank
        rows = slice(g0 * self.group_size, (g0 + per_rank) * self.group_size)
        return values[rows], scales[g0 : g0 + per_rank], zeros[g0 : g0 + per_rank], perm[rows]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gathers_input:
            x = x.index_select(1, layer.input_index)  # [num_tokens, full K] -> [.., K / tp]
        return super().apply(layer, x, bias)

    def _shared_g_idx(self, g_idx: torch.Tensor, groups: int) -> torch.Tensor:
        """The one g_idx of all shards (act-order of one input is the same for each)."""
        if not all(torch.equal(row, g_idx[0]) for row in g_idx[1:]):
            raise ValueError(
                f"{self.prefix}.g_idx: the merged shards disagree on the act-order of their "
                "shared input, which is not supported"
            )
        first = g_idx[0]
        if first.numel() and (int(first.min()) < 0 or int(first.max()) >= groups):
            raise ValueError(f"{self.prefix}.g_idx: group indices must lie in [0, {groups})")
        return first
