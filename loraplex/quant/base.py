"""The contract between a linear layer and the way its weight is stored.

A `LinearMethod` owns the parameters of one linear layer (plain, or a merged one such as QKV or
gate-up), the fix-ups after the checkpoint is loaded, and the matmul. The layer itself
(`loraplex.platform.models.linear.Linear`) is generic: it loads tensors through the
per-parameter attributes set here, and adds an optional LoRA delta on top of `apply`.

Parameter attributes read by the generic weight loader:
- `output_dim`: which dimension of the parameter runs along the layer's output features, or
  None when the parameter has no output dimension (then every shard loads the same tensor,
  unless `shard_indexed` is set).
- `output_pack`: how many output features one element along `output_dim` holds (8 for int4
  packed into int32 along N; 128 for 128x128 block scales; 1 otherwise).
- `shard_indexed`: the parameter holds one row per logical shard (per-tensor scales of a merged
  layer); shard i loads into row i.
- `input_dim` / `input_pack`: the same for the input features, read when a row-parallel layer
  (tensor parallelism) loads its slice of the inputs; None: every rank loads the whole tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class LinearMethod(ABC):
    """How one linear layer stores and applies its weight."""

    #: short name for logs ("unquantized", "awq", ...)
    name: str = "base"

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: list[int],
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's parameters (with the attributes above) on `layer`."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027
        """Repack or convert loaded tensors for the kernels (optional)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W^T (+ bias). x: [num_tokens, input_size] -> [num_tokens, sum(output_sizes)]."""

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The effective weight [sum(output_sizes), input_size] in the activation dtype.

        Used by references and tests; never on the hot path."""
        raise NotImplementedError(f"{self.name} does not expose a dequantized weight")


class QuantizationConfig(ABC):
    """A checkpoint's `quantization_config`, parsed: hands out a `LinearMethod` per layer."""

    #: the `quant_method` names this config answers to
    names: tuple[str, ...] = ()

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Parse and validate; raise ValueError naming the unsupported setting."""

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer whose checkpoint prefix is `prefix`."""


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)
