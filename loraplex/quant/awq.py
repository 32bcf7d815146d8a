"""AWQ checkpoints in AutoAWQ's "gemm" layout (4-bit, zero points, fp16 scales).

Per linear layer with input size K and output size N, groups of `group_size` input features:
- `qweight` [K, N / 8] int32, packed along N in the nibble order 0, 2, 4, 6, 1, 3, 5, 7;
- `qzeros` [K / group_size, N / 8] int32, packed the same way;
- `scales` [K / group_size, N] fp16;
weight[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n].
At load the weight is repacked for the W4A16 kernels (see `loraplex.quant.wna16`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraplex.quant.base import LinearMethod, QuantizationConfig, set_weight_attrs
from loraplex.quant.packing import AWQ_PACK_ORDER, unpack_int32
from loraplex.quant.registry import register_quantization
from loraplex.quant.unquantized import UnquantizedLinearMethod
from loraplex.quant.wna16 import (
    WNA16LinearMethod,
    check_output_sizes,
    resolve_group_size,
)

AWQ_GROUP_SIZES = (32, 64, 128, -1)
_PACK = 8


@register_quantization
class AWQConfig(QuantizationConfig):
    """`quant_method: "awq"` (transformers' keys) or AutoAWQ's quant_config.json keys."""

    names = ("awq",)

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = int(config.get("bits", config.get("w_bit", 4)))
        group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ version {version!r} is not supported; only AutoAWQ's 'gemm' layout is "
                "(re-export the model with version='gemm')"
            )
        if bits != 4:
            raise ValueError(f"AWQ bits={bits} is not supported; only 4-bit AWQ is")
        if group_size not in AWQ_GROUP_SIZES:
            raise ValueError(
                f"AWQ group_size={group_size} is not supported; supported: {AWQ_GROUP_SIZES}"
            )
        if not config.get("zero_point", True):
            raise ValueError("AWQ zero_point=false is not supported; the gemm layout has zeros")
        return cls(group_size, list(config.get("modules_to_not_convert") or []))

    def linear_method(self, prefix: str) -> LinearMethod:
        if any(module in prefix for module in self.modules_to_not_convert):
            return UnquantizedLinearMethod()
        return AWQLinearMethod(prefix, self.group_size)


class AWQLinearMethod(WNA16LinearMethod):
    name = "awq"

    def __init__(self, prefix: str, group_size: int) -> None:
        super().__init__(prefix, bits=4)
        self.checkpoint_group_size = group_size

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        check_output_sizes(self.prefix, "AWQ", output_sizes, _PACK)
        self.group_size = resolve_group_size(
            self.prefix, "AWQ", self.checkpoint_group_size, input_size
        )
        self.params_dtype = params_dtype
        n, groups = sum(output_sizes), input_size // self.group_size
        qweight = nn.Parameter(
            torch.empty(input_size, n // _PACK, dtype=torch.int32), requires_grad=False
        )
        qzeros = nn.Parameter(
            torch.empty(groups, n // _PACK, dtype=torch.int32), requires_grad=False
        )
        scales = nn.Parameter(torch.empty(groups, n, dtype=torch.float16), requires_grad=False)
        # NOTE: a row-parallel rank holds whole groups of inputs; with one group over the whole
        # input (group_size -1) every rank keeps the one row of scales and zeros.
        group_dim = 0 if self.checkpoint_group_size != -1 else None
        set_weight_attrs(qweight, output_dim=1, output_pack=_PACK, input_dim=0, input_pack=1)
        set_weight_attrs(
            qzeros, output_dim=1, output_pack=_PACK, input_dim=group_dim, input_pack=self.group_size
        )
        set_weight_attrs(
            scales, output_dim=1, output_pack=1, input_dim=group_dim, input_pack=self.group_size
        )
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_PACK_ORDER)  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_PACK_ORDER)  # [G, N]
        self.finish_wna16(layer, q, layer.scales.data, zeros.to(torch.float16), None)
