"""Random weights for a real architecture, generated on the device from a seed.

Each parameter draws from its own generator seeded by (seed, parameter name), so the same
seed gives the same weights whatever the device order, and a baseline (HF transformers) can be
handed the very same tensors through `hf_state_dict`.

Quantized linear layers (AWQ, GPTQ, serialized FP8) get random tensors in their *checkpoint*
format: packed int32 words of random 4/8-bit values, zero points near the middle of the range,
positive scales; FP8 weights with their scales. Scales are chosen so the dequantized weights
have the same std as the dense ones. The caller then runs the post-load processing a real
checkpoint goes through (`model_loader.finish_loading`), so the kernels see the same layout.

A tensor-parallel rank (`init_random_weights_sharded`) generates each full tensor exactly as the
unsplit model would, one at a time, and loads it through the checkpoint loader, which keeps only
its slice: every tensor-parallel size holds the same full weights.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from loraplex.platform.models.linear import Linear
from loraplex.platform.models.weight_loader import load_named_weights
from loraplex.quant.packing import AWQ_PACK_ORDER, pack_int32

_STD = 0.02
_DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Scales are drawn uniformly from base * [1 - spread, 1 + spread].
_SCALE_SPREAD = 0.25
#: Zero points of a `bits`-wide format are drawn from [2**(bits-1) - 2, 2**(bits-1) + 2).
_ZERO_SPREAD = 2
_FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8_DTYPE).max
#: FP8 weights are drawn as N(0, (FP8_MAX / _FP8_SIGMAS)^2), clipped at +-FP8_MAX.
_FP8_SIGMAS = 4.0
#: NOTE: random weights have no calibration data for static FP8 activation scales; hidden states
#: of a random model with unit norms stay within a few units, so this bound leaves headroom.
_FP8_STATIC_INPUT_ABS_MAX = 16.0

#: fill(layer, param, generator) for one checkpoint-format parameter of a quantized layer.
ParamFill = Callable[[Linear, torch.Tensor, torch.Generator], None]


def _generator(param: torch.Tensor, seed: int, name: str) -> torch.Generator:
    return torch.Generator(device=param.device).manual_seed(
        seed * 1_000_003 + zlib.crc32(name.encode())
    )


def _scale_second_moment() -> float:
    """E[u^2] of the scale multiplier u ~ U(1 - spread, 1 + spread)."""
    return 1.0 + (2 * _SCALE_SPREAD) ** 2 / 12


def _fill_scales(param: torch.Tensor, base: float, gen: torch.Generator) -> None:
    """Positive scales base * U(1 - spread, 1 + spread), any shape and float dtype."""
    param.uniform_(base * (1 - _SCALE_SPREAD), base * (1 + _SCALE_SPREAD), generator=gen)


def _fill_dense(param: torch.Tensor, name: str, gen: torch.Generator) -> None:
    if param.dtype not in _DENSE_DTYPES:
        raise ValueError(f"no random values for {name} ({param.dtype}) of an unquantized layer")
    if name.endswith("norm.weight"):
        param.fill_(1.0)
    else:
        param.normal_(0.0, _STD, generator=gen)


def _fill_packed_words(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    """int32 words of uniformly random 4- or 8-bit values (every bit pattern equally likely)."""
    param.random_(-(1 << 31), 1 << 31, generator=gen)


def _random_zeros(param: torch.Tensor, bits: int, pack: int, gen: torch.Generator) -> torch.Tensor:
    """Zero points [rows, words * pack] near the middle of the `bits`-wide range."""
    mid = 1 << (bits - 1)
    rows, words = param.shape
    return torch.randint(
        mid - _ZERO_SPREAD, mid + _ZERO_SPREAD, (rows, words * pack),
        generator=gen, device=param.device, dtype=torch.int32,
    )  # fmt: skip


def _fill_awq_zeros(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    zeros = _random_zeros(param, 4, 8, gen)  # [G, N]
    param.copy_(pack_int32(zeros, 4, dim=1, order=AWQ_PACK_ORDER))  # [G, N / 8]


def _fill_gptq_zeros(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    bits = layer.method.bits
    zeros = _random_zeros(param, bits, 32 // bits, gen)  # [G, N]
    if layer.method.config.checkpoint_format == "gptq":
        zeros = zeros - 1  # v1 stores zero - 1
    param.copy_(pack_int32(zeros, bits, dim=1))  # [G, N / pack]


def _fill_wna16_scales(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    """Scales that give the dequantized weight (q - zero) * scale a std of `_STD`."""
    levels = 1 << layer.method.bits
    # NOTE: q is uniform over the levels and zero uniform over 2 * _ZERO_SPREAD integers with
    # the same mean, so E[(q - zero)^2] is the sum of their variances.
    q_minus_zero = (levels**2 - 1) / 12 + ((2 * _ZERO_SPREAD) ** 2 - 1) / 12
    _fill_scales(param, _STD / math.sqrt(q_minus_zero * _scale_second_moment()), gen)


def _fill_g_idx(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    """Group of each input feature: plain order, or a random act-order shared by all shards."""
    k, group_size = param.shape[1], layer.method.group_size
    groups = torch.arange(k, dtype=torch.int32, device=param.device) // group_size  # [K]
    if layer.method.config.desc_act:
        order = torch.randperm(k, generator=gen, device=param.device)
        groups = torch.empty_like(groups).index_copy_(0, order, groups)
    param.copy_(groups.expand_as(param))  # [shards, K]


def _fill_fp8_weight(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    if param.dtype in _DENSE_DTYPES:  # quantized at load (`--quantization fp8`)
        param.normal_(0.0, _STD, generator=gen)
        return
    values = torch.randn(param.shape, generator=gen, device=param.device)  # [N, K]
    values = (values * (_FP8_MAX / _FP8_SIGMAS)).clamp(-_FP8_MAX, _FP8_MAX)
    param.copy_(values.to(param.dtype))


def _fill_fp8_weight_scale(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    """Per tensor, channel or block: the dequantized weight gets a std of `_STD`."""
    base = _STD * _FP8_SIGMAS / _FP8_MAX / math.sqrt(_scale_second_moment())
    _fill_scales(param, base, gen)


def _fill_fp8_input_scale(layer: Linear, param: torch.Tensor, gen: torch.Generator) -> None:
    param.fill_(_FP8_STATIC_INPUT_ABS_MAX / _FP8_MAX)


#: Per weight method (`LinearMethod.name`), how to fill each of its checkpoint parameters.
#: Parameters a method does not list (a bias) are filled as dense ones.
_QUANTIZED_FILLS: dict[str, dict[str, ParamFill]] = {
    "awq": {"qweight": _fill_packed_words, "qzeros": _fill_awq_zeros, "scales": _fill_wna16_scales},
    "gptq": {
        "qweight": _fill_packed_words,
        "qzeros": _fill_gptq_zeros,
        "scales": _fill_wna16_scales,
        "g_idx": _fill_g_idx,
    },
    "fp8": {
        "weight": _fill_fp8_weight,
        "weight_scale": _fill_fp8_weight_scale,
        "weight_scale_inv": _fill_fp8_weight_scale,
        "input_scale": _fill_fp8_input_scale,
    },
}


def _linear_fills(model: nn.Module) -> dict[str, tuple[Linear, ParamFill]]:
    """Full parameter name -> (its layer, its fill) for every quantized linear layer."""
    fills: dict[str, tuple[Linear, ParamFill]] = {}
    for path, module in model.named_modules():
        if not isinstance(module, Linear) or module.method.name == "unquantized":
            continue
        method_fills = _QUANTIZED_FILLS.get(module.method.name)
        if method_fills is None:
            raise ValueError(
                f"random weights for {module.method.name} layers are not supported ({path}); "
                f"supported: {sorted(_QUANTIZED_FILLS)}"
            )
        for pname, _ in module.named_parameters(recurse=False):
            if pname in method_fills:
                fills[f"{path}.{pname}"] = (module, method_fills[pname])
    return fills


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` from `seed`: dense weights ~ N(0, 0.02), norms 1,
    quantized layers in their checkpoint format (run `finish_loading` afterwards)."""
    fills = _linear_fills(model)
    for name, param in model.named_parameters():
        _fill(fills, name, param, seed)


def _fill(
    fills: dict[str, tuple[Linear, ParamFill]], name: str, param: torch.Tensor, seed: int
) -> None:
    gen = _generator(param, seed, name)
    if name in fills:
        layer, fill = fills[name]
        fill(layer, param, gen)
    else:
        _fill_dense(param, name, gen)


def _checkpoint_shards(
    layer: Linear, base: str, pname: str, full: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """A merged layer's full parameter split back into its checkpoint projections' tensors."""
    sizes = layer.full_output_sizes
    dim = getattr(full, "output_dim", None)
    start = 0
    for i, shard in enumerate(layer.shard_names):
        name = f"model.{base}.{shard}.{pname}"
        if getattr(full, "shard_indexed", False):
            yield name, full.data[i]
        elif dim is not None:
            rows = -(-sizes[i] // getattr(full, "output_pack", 1))
            yield name, full.data.narrow(dim, start, rows)
            start += rows
        else:
            yield name, full.data


@torch.no_grad()
def init_random_weights_sharded(
    model: nn.Module, full_model: nn.Module, seed: int, device: torch.device
) -> None:
    """Fill a tensor-parallel rank's `model` with its slices of the weights `init_random_weights`
    gives the unsplit model. `full_model`: the unsplit model built on the meta device (its
    shapes and parameter attributes only)."""
    fills = _linear_fills(full_model)
    renames = {v: k for k, v in getattr(full_model, "checkpoint_renames", {}).items()}
    linears = {path: m for path, m in full_model.named_modules() if isinstance(m, Linear)}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, meta_param in full_model.named_parameters():
            full = torch.empty(meta_param.shape, dtype=meta_param.dtype, device=device)
            full.__dict__.update(meta_param.__dict__)  # the loader's attributes
            _fill(fills, name, full, seed)
            module_path, _, pname = name.rpartition(".")
            layer = linears.get(module_path)
            if layer is not None:
                yield from _checkpoint_shards(layer, module_path.rpartition(".")[0], pname, full)
            else:
                yield renames.get(name, f"model.{name}"), full

    load_named_weights(model, tensors())


@torch.no_grad()
def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names, merged layers split back (views, no copies,
    except of a weight held packed: `dequantized_weight` unpacks it)."""
    out: dict[str, torch.Tensor] = {}
    renames = {v: k for k, v in getattr(model, "checkpoint_renames", {}).items()}
    for module_path, module in model.named_modules():
        if isinstance(module, Linear):
            if module.method.name != "unquantized":
                raise ValueError(
                    f"hf_state_dict needs an unquantized model; {module_path} is "
                    f"{module.method.name}"
                )
            base = module_path.rpartition(".")[0]
            offsets = module.shard_offsets()
            weight = module.method.dequantized_weight(module)
            for i, shard in enumerate(module.shard_names):
                out[f"model.{base}.{shard}.weight"] = weight[offsets[i] : offsets[i + 1]]
                if module.bias is not None:
                    out[f"model.{base}.{shard}.bias"] = module.bias[offsets[i] : offsets[i + 1]]
            continue
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_path}.{pname}" if module_path else pname
            out[renames.get(full, f"model.{full}")] = param
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out
