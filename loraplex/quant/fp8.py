"""FP8 (e4m3) W8A8 linear layers, from three sources:

- compressed-tensors "float-quantized" checkpoints (llm-compressor): `weight` fp8 [N, K] with
  `weight_scale` per tensor ([1] per shard) or per channel ([N, 1]) or in blocks; activations
  dynamic per token, or static per tensor (`input_scale`);
- `quant_method: "fp8"` checkpoints: with `weight_block_size` [bn, bk], `weight_scale_inv`
  [ceil(N / bn), ceil(K / bk)] (the dequantization multiplier, despite its name) and dynamic
  per-token-per-block activations; without, a per-tensor `weight_scale` (+ `input_scale`);
- `--quantization fp8` on a bf16 checkpoint: the weight is quantized per channel at load.

After load every variant holds `weight` fp8 [N, K] and `weight_scale` fp32 with one row per
output feature ([N, 1], or [N, KB] for blocks), which `loraplex.kernels.fp8_gemm` consumes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loraplex.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX, expand_block_scales, fp8_linear
from loraplex.quant.base import LinearMethod, QuantizationConfig, set_weight_attrs
from loraplex.quant.registry import register_quantization
from loraplex.quant.unquantized import UnquantizedLinearMethod
from loraplex.quant.wna16 import replace_param

logger = logging.getLogger(__name__)
_STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Scheme:
    """How one checkpoint stores FP8 weights and scales its activations."""

    strategy: str  # "tensor" | "channel" | "block"
    block_size: tuple[int, int] | None  # (block_n, block_k) for "block"
    static_input: bool  # a per-tensor `input_scale` instead of dynamic scales
    serialized: bool  # False: a bf16 checkpoint quantized at load
    scale_name: str = "weight_scale"

    def __post_init__(self) -> None:
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"FP8 weight strategy must be one of {_STRATEGIES}: {self.strategy}")
        if (self.strategy == "block") != (self.block_size is not None):
            raise ValueError("FP8 block scales need a block size, and only they take one")
        if self.block_size is not None:
            block_k = self.block_size[1]
            if block_k < 16 or block_k & (block_k - 1) or self.block_size[0] <= 0:
                raise ValueError(f"FP8 block size {list(self.block_size)} is not supported")
            if self.static_input:
                raise ValueError("FP8 block scales need dynamic activation scales")


def _is_ignored(prefix: str, ignore: list[str]) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], prefix):
                return True
        elif prefix == entry or prefix.endswith("." + entry) or entry in prefix.split("."):
            return True
    return False


@register_quantization
class CompressedTensorsConfig(QuantizationConfig):
    """`quant_method: "compressed-tensors"` with format "float-quantized" (FP8 W8A8)."""

    names = ("compressed-tensors",)

    def __init__(self, scheme: Fp8Scheme, ignore: list[str]) -> None:
        self.scheme = scheme
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        fmt = config.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(
                f"compressed-tensors format {fmt!r} is not supported; only FP8 "
                "'float-quantized' checkpoints are"
            )
        if config.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors kv_cache_scheme is not supported")
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1 or "Linear" not in groups[0].get("targets", []):
            raise ValueError("compressed-tensors: expected one config group targeting 'Linear'")
        weights = groups[0].get("weights") or {}
        acts = groups[0].get("input_activations")
        for role, args in (("weights", weights), ("input_activations", acts)):
            if not args or args.get("num_bits") != 8 or args.get("type") != "float":
                raise ValueError(
                    f"compressed-tensors {role}: only 8-bit float quantization is supported "
                    f"(W8A8 FP8), got {args}"
                )
            if not args.get("symmetric", True):
                raise ValueError(f"compressed-tensors {role}: asymmetric FP8 is not supported")
        strategy = weights.get("strategy")
        block = weights.get("block_structure")
        static = not acts.get("dynamic", False)
        if static and acts.get("strategy") != "tensor":
            raise ValueError("compressed-tensors: static activation scales must be per tensor")
        if not static and acts.get("strategy") not in ("token", "group"):
            raise ValueError(
                f"compressed-tensors: dynamic activation strategy {acts.get('strategy')!r} "
                "is not supported; use 'token'"
            )
        if acts.get("strategy") == "group" and strategy != "block":
            raise ValueError("compressed-tensors: per-group activations need block weights")
        scheme = Fp8Scheme(
            strategy=strategy,
            block_size=tuple(int(b) for b in block) if block else None,
            static_input=static,
            serialized=True,
        )
        return cls(scheme, list(config.get("ignore") or []))

    def linear_method(self, prefix: str) -> LinearMethod:
        if _is_ignored(prefix, self.ignore):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(prefix, self.scheme)


@register_quantization
class Fp8Config(QuantizationConfig):
    """`quant_method: "fp8"` checkpoints, or (an empty config) `--quantization fp8` at load."""

    names = ("fp8",)

    def __init__(self, scheme: Fp8Scheme, ignore: list[str]) -> None:
        self.scheme = scheme
        self.ignore = ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        if not config:
            return cls(Fp8Scheme("channel", None, static_input=False, serialized=False), [])
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 fmt {fmt!r} is not supported; only e4m3 is")
        activation = config.get("activation_scheme", "dynamic")
        if activation not in ("dynamic", "static"):
            raise ValueError(f"FP8 activation_scheme {activation!r} is not supported")
        block = config.get("weight_block_size")
        scheme = Fp8Scheme(
            strategy="block" if block else "tensor",
            block_size=(int(block[0]), int(block[1])) if block else None,
            static_input=activation == "static",
            serialized=True,
            scale_name="weight_scale_inv" if block else "weight_scale",
        )
        ignore = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(scheme, list(ignore))

    def linear_method(self, prefix: str) -> LinearMethod:
        if _is_ignored(prefix, self.ignore):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(prefix, self.scheme)


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest FP8 of weight [N, K]: (fp8 [N, K], fp32 scales [N, 1])."""
    scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


class Fp8LinearMethod(LinearMethod):
    name = "fp8"

    def __init__(self, prefix: str, scheme: Fp8Scheme) -> None:
        self.prefix = prefix
        self.scheme = scheme
        self.output_sizes: list[int] = []
        self.params_dtype = torch.bfloat16

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        scheme, shards = self.scheme, len(output_sizes)
        self.output_sizes, self.params_dtype = list(output_sizes), params_dtype
        n = sum(output_sizes)
        weight_dtype = FP8_DTYPE if scheme.serialized else params_dtype
        params: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {
            "weight": (
                torch.empty(n, input_size, dtype=weight_dtype),
                {"output_pack": 1, "input_dim": 1, "input_pack": 1},
            )
        }
        if scheme.serialized and scheme.strategy == "tensor":
            params[scheme.scale_name] = (torch.empty(shards), {"shard_indexed": True})
        elif scheme.serialized and scheme.strategy == "channel":
            params[scheme.scale_name] = (torch.empty(n, 1), {"output_pack": 1})
        elif scheme.serialized:
            block_n, block_k = scheme.block_size  # type: ignore[misc]
            rows = sum(-(-size // block_n) for size in output_sizes)
            scale = torch.empty(rows, -(-input_size // block_k))
            params[scheme.scale_name] = (
                scale,
                {"output_pack": block_n, "input_dim": 1, "input_pack": block_k},
            )
        if scheme.static_input:
            params["input_scale"] = (torch.empty(shards), {"shard_indexed": True})
        for name, (tensor, attrs) in params.items():
            param = nn.Parameter(tensor, requires_grad=False)
            set_weight_attrs(param, output_dim=0 if "output_pack" in attrs else None, **attrs)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scheme, sizes = self.scheme, self.output_sizes
        weight = layer.weight.data  # [N, K]
        if not scheme.serialized:
            weight, scale = quantize_weight_per_channel(weight)
        elif scheme.strategy == "tensor":
            per_shard = layer.weight_scale.data.float()  # [shards]
            lengths = torch.tensor(sizes, device=per_shard.device)
            scale = per_shard.repeat_interleave(lengths).unsqueeze(1)  # [N, 1]
        elif scheme.strategy == "channel":
            scale = layer.weight_scale.data.float()
        else:
            scale = self._expand_blocks(getattr(layer, scheme.scale_name).data)
        replace_param(layer, "weight", weight)
        replace_param(layer, scheme.scale_name, None)
        replace_param(layer, "weight_scale", scale.contiguous())
        if scheme.static_input:
            replace_param(layer, "input_scale", layer.input_scale.data.float().max().reshape(1))
        where = "triton" if weight.is_cuda else "torch reference"
        logger.debug("%s: fp8 W8A8 %s weights, %s", self.prefix, scheme.strategy, where)

    def _expand_blocks(self, scale_inv: torch.Tensor) -> torch.Tensor:
        """Block scales of each shard -> per-row scales [N, KB]."""
        block_n = self.scheme.block_size[0]  # type: ignore[index]
        rows, start = [], 0
        for size in self.output_sizes:
            blocks = -(-size // block_n)
            rows.append(expand_block_scales(scale_inv[start : start + blocks], size, block_n))
            start += blocks
        return torch.cat(rows)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        block_k = self.scheme.block_size[1] if self.scheme.block_size else None
        input_scale = layer.input_scale if self.scheme.static_input else None
        return fp8_linear(
            x, layer.weight, layer.weight_scale, block_k=block_k, input_scale=input_scale, bias=bias
        )

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        k = layer.weight.shape[1]
        step = self.scheme.block_size[1] if self.scheme.block_size else k
        scale = layer.weight_scale.repeat_interleave(step, dim=1)[:, :k]  # [N, K]
        return (layer.weight.float() * scale).to(self.params_dtype)  # [N, K]
