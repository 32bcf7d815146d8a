"""Plain dense weights in the model dtype.

On CPU in fp32 the loaded weight is replaced by its oneDNN-packed form (`cpu_linear.pack`): the
layer keeps `packed_weight` and no `weight` parameter, one copy of the weight instead of two;
`dequantized_weight` unpacks a copy. Where oneDNN's layout is not the one its GEMV reads, the
plain weight stays, with a packed copy beside it (`cpu_linear.prepack`).
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.cpu_linear import linear_packed, pack, prepack
from loraplex.kernels.gemv import linear
from loraplex.quant.base import LinearMethod, set_weight_attrs


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=params_dtype), requires_grad=False
        )
        set_weight_attrs(weight, output_dim=0, output_pack=1, input_dim=1, input_pack=1)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = pack(layer.weight)
        if packed is None:
            prepack(layer.weight)
            return
        del layer.weight
        layer.packed_weight = packed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = layer.__dict__.get("packed_weight")
        if packed is not None:
            return linear_packed(x, packed, bias)
        return linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        packed = layer.__dict__.get("packed_weight")
        return layer.weight if packed is None else packed.to_dense()
