"""Build a model from a Hugging Face-layout folder: architecture, dtype, quantization, weights."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from loraplex.kernels.cpu_linear import prepack
from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.models.dummy_weights import (
    init_random_weights,
    init_random_weights_sharded,
)
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.registry import get_model_class
from loraplex.platform.models.weight_loader import iterate_checkpoint
from loraplex.platform.parallel.parallel_state import SINGLE, TensorParallel
from loraplex.quant.base import QuantizationConfig
from loraplex.quant.registry import find_quantization_config, get_quantization_config

logger = logging.getLogger(__name__)

#: Methods `--quantization` applies to unquantized weights at load; the others (awq, gptq,
#: compressed-tensors) name a checkpoint format and come from the checkpoint's config.
LOAD_TIME_QUANTIZATION = ("fp8",)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, arch: ArchConfig, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA (fp32 checkpoints run in bf16 there), fp32 on CPU."""
    if dtype != "auto":
        return _TORCH_DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if arch.torch_dtype == "float16" else torch.bfloat16


def quantization_for(
    model_dir: Path, arch: ArchConfig, quantization: str | None
) -> QuantizationConfig | None:
    return get_quantization_config(quantization, find_quantization_config(model_dir, arch.raw))


def build_model(
    arch: ArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantizationConfig | None = None,
    tp: TensorParallel = SINGLE,
) -> nn.Module:
    """The architecture's model with empty weights; under tensor parallelism, this rank's part."""
    cls = get_model_class(arch.architecture)
    with torch.device(device):
        model = cls(arch, quant, dtype, tp=tp) if tp.enabled else cls(arch, quant, dtype)
    return model.eval()


def finish_loading(model: nn.Module) -> None:
    """Let each linear layer's weight method repack what it loaded; pack a plain LM head for
    the CPU's fp32 linear too (`cpu_linear.prepack`)."""
    methods: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
            methods[module.method.name] = methods.get(module.method.name, 0) + 1
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, torch.Tensor):
        prepack(lm_head)
    logger.info("linear layers by weight method: %s", methods)


def load_model(
    model_path: Path,
    dtype: str,
    device: torch.device,
    quantization: str | None = None,
    random_seed: int | None = None,
    tp: TensorParallel = SINGLE,
) -> tuple[nn.Module, ArchConfig, torch.dtype]:
    """Load a Hugging Face-layout folder, or, given a config.json file, build that architecture
    with random weights generated on the device from `random_seed` (for benchmarks). Under
    tensor parallelism (`tp`) this rank's part, reading only its slices of the checkpoint."""
    model_path = Path(model_path)
    if model_path.is_file():
        return load_random_model(model_path, dtype, device, quantization, random_seed or 0, tp)
    arch = ArchConfig.from_path(model_path)
    torch_dtype = resolve_dtype(dtype, arch, device)
    quant = quantization_for(model_path, arch, quantization)
    model = build_model(arch, torch_dtype, device, quant, tp)
    model.load_weights(iterate_checkpoint(model_path, lazy=tp.enabled))
    finish_loading(model)
    return model, arch, torch_dtype


def load_random_model(
    config_path: Path,
    dtype: str,
    device: torch.device,
    quantization: str | None,
    seed: int,
    tp: TensorParallel = SINGLE,
) -> tuple[nn.Module, ArchConfig, torch.dtype]:
    """The architecture of a bare config.json with random weights generated on the device.

    A `quantization_config` in the file makes the weights random in that checkpoint format
    (e.g. configs/models/llama-3.1-8b-awq.json); `quantization` may name a method that
    quantizes at load (`LOAD_TIME_QUANTIZATION`). Either way the weights then go through the
    same post-load processing as a real checkpoint's."""
    arch = ArchConfig.from_path(config_path)
    torch_dtype = resolve_dtype(dtype, arch, device)
    checkpoint_quant = arch.raw.get("quantization_config")
    if (
        quantization is not None
        and checkpoint_quant is None
        and quantization not in LOAD_TIME_QUANTIZATION
    ):
        raise ValueError(
            f"--quantization {quantization} names a checkpoint format, not a quantization at "
            f"load: random {quantization} weights need a 'quantization_config' in "
            f"{config_path} (e.g. configs/models/llama-3.1-8b-awq.json); random weights are "
            f"quantized at load only by {list(LOAD_TIME_QUANTIZATION)}"
        )
    quant = get_quantization_config(quantization, checkpoint_quant)
    model = build_model(arch, torch_dtype, device, quant, tp)
    if tp.enabled:
        full = build_model(arch, torch_dtype, torch.device("meta"), quant)
        init_random_weights_sharded(model, full, seed, device)
    else:
        init_random_weights(model, seed)
    finish_loading(model)
    return model, arch, torch_dtype


def generation_eos_ids(model_dir: Path, arch: ArchConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json if present, else config.json."""
    path = Path(model_dir) / "generation_config.json"
    if Path(model_dir).is_file():  # a bare config.json of a random-weight model
        return arch.eos_token_ids
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and eos:
            return tuple(int(e) for e in eos)
    return arch.eos_token_ids
