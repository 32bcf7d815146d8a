"""What AWQ and GPTQ layers share once loaded: int4/int8 weights in the kernels' layout.

Both formats unpack their checkpoint tensors to integer values and hand them to `finish_wna16`,
which repacks them (`w4a16_repack`) into the layout of `loraplex.kernels.w4a16`: `qweight`
[N, K_pad / pack], `scales` [G, N], `zeros` [G, N] as floats, `perm` [K] for act-order. From
there one `apply` serves both.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loraplex import envs
from loraplex.kernels.w4a16 import w4a16_gemm
from loraplex.kernels.w4a16.dispatch import use_selection_table
from loraplex.kernels.w4a16.reference import dequantize_reference
from loraplex.quant.base import LinearMethod
from loraplex.quant.w4a16_repack import repack_w4a16

logger = logging.getLogger(__name__)
_LOGGED_CHOICES: set[str] = set()


def check_output_sizes(prefix: str, method: str, output_sizes: list[int], multiple: int) -> None:
    """Every shard must fill whole int32 words along the packed output dim."""
    for size in output_sizes:
        if size % multiple:
            raise ValueError(
                f"{prefix}: {method} packs {multiple} outputs per int32 word, "
                f"but an output size is {size} (sizes {output_sizes})"
            )


def resolve_group_size(prefix: str, method: str, group_size: int, input_size: int) -> int:
    """The group size in features (-1 means the whole input) after checking it divides K."""
    size = input_size if group_size == -1 else group_size
    if input_size % size:
        raise ValueError(
            f"{prefix}: {method} group_size {group_size} does not divide the input size {input_size}"
        )
    return size


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swap a loaded parameter for its repacked form (or drop it when value is None)."""
    if hasattr(layer, name):
        delattr(layer, name)
    if value is not None:
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))


class WNA16LinearMethod(LinearMethod):
    """Base of AWQ and GPTQ: subclasses load their format and call `finish_wna16`."""

    def __init__(self, prefix: str, bits: int) -> None:
        self.prefix = prefix
        self.bits = bits
        self.group_size = 0  # in features, set by create_weights
        self.params_dtype = torch.float16  # the activation dtype, set by create_weights

    def finish_wna16(
        self,
        layer: nn.Module,
        values: torch.Tensor,  # [K, N] integers, input features in weight order
        scales: torch.Tensor,  # [G, N]
        zeros: torch.Tensor,  # [G, N]
        perm: torch.Tensor | None,  # [K] int32: the input feature of each weight row
    ) -> None:
        """Repack into the kernels' layout on `layer` and log which kernel it will run
        (dispatching from the selection table file LORAPLEX_QUANT_GEMM_TABLE names, if set)."""
        table = envs.quant_gemm_table()
        if table is not None:
            use_selection_table(table)
        qweight = repack_w4a16(values, self.bits)
        replace_param(layer, "qweight", qweight)  # [N, K_pad / pack] int32
        replace_param(layer, "scales", scales)  # [G, N]
        replace_param(layer, "zeros", zeros.to(scales.dtype))  # [G, N]
        replace_param(layer, "qzeros", None)
        replace_param(layer, "g_idx", None)
        replace_param(layer, "perm", perm)  # [K] int32 or None
        if qweight.is_cuda:
            kernel = f"triton W{self.bits}A16 (fused tensor-core kernel or dequant + cuBLAS by M)"
        else:
            kernel = "torch reference (dequantize + matmul)"
        act_order = ", act-order" if perm is not None else ""
        choice = f"{self.name} {self.bits}-bit g{self.group_size}{act_order}: {kernel}"
        if choice not in _LOGGED_CHOICES:
            _LOGGED_CHOICES.add(choice)
            logger.info("quantized linear %s (first: %s)", choice, self.prefix)
        logger.debug("%s [N=%d, K=%d] %s", self.prefix, *values.shape[::-1], choice)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w4a16_gemm(
            x, layer.qweight, layer.scales, layer.zeros, self.group_size, self.bits,
            getattr(layer, "perm", None), bias,
        )  # fmt: skip

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        w = dequantize_reference(
            layer.qweight, layer.scales, layer.zeros, self.group_size, self.bits,
            getattr(layer, "perm", None),
        )  # fmt: skip
        return w.t().to(self.params_dtype)  # [N, K]
