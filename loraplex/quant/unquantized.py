"""Plain dense weights in the model dtype."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.cpu_linear import prepack
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
        prepack(layer.weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight
