"""Random PEFT LoRA adapters for a model architecture, written without building the HF model.

Benchmarks on the Llama-3.1-8B shape need adapters of that shape; building the 8B HF model to
let `peft` save them would cost minutes and 16 GB. This writes the two files PEFT writes
(`adapter_config.json`, `adapter_model.safetensors`) with PEFT's tensor names, random A and
non-zero random B, so the loader validates and serves them like any uploaded adapter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.platform.models.arch_config import ArchConfig

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one decoder layer."""
    h, i = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (h, arch.q_size),
        "k_proj": (h, arch.kv_size),
        "v_proj": (h, arch.kv_size),
        "o_proj": (arch.q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def write_random_adapter(
    folder: str | Path,
    arch: ArchConfig,
    *,
    rank: int = 16,
    seed: int = 0,
    modules: tuple[str, ...] = ALL_MODULES,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    base_model_name: str = "",
    dora_magnitude: Callable[[int, str], torch.Tensor] | None = None,
    lm_head: bool = False,
) -> int:
    """Write a rank-`rank` adapter on `modules` of every layer; returns its bytes on disk.

    A ~ N(0, 1/in) and B ~ N(0, 1/rank) keep the delta's scale near the base projection's, so
    outputs stay finite; the tensors are generated on `device` (fast on a GPU) from `seed`.
    `dora_magnitude(layer, module)` (a `[out_features]` tensor, e.g. the base rows' norms)
    makes it a DoRA adapter; `lm_head` adds LoRA on the output head."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = module_shapes(arch)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(arch.num_layers):
        for module in modules:
            in_features, out_features = shapes[module]
            block = (
                "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            )
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = torch.randn(rank, in_features, generator=gen, device=device) / in_features**0.5
            b = torch.randn(out_features, rank, generator=gen, device=device) / rank**0.5
            tensors[f"{name}.lora_A.weight"] = a.to(dtype).cpu()
            tensors[f"{name}.lora_B.weight"] = b.to(dtype).cpu()
            if dora_magnitude is not None:
                magnitude = dora_magnitude(layer, module).float()  # [out_features]
                tensors[f"{name}.lora_magnitude_vector"] = magnitude.to(dtype).cpu()
    targets = list(modules)
    if lm_head:
        h = arch.hidden_size
        a = torch.randn(rank, h, generator=gen, device=device) / h**0.5
        b = torch.randn(arch.vocab_size, rank, generator=gen, device=device) / rank**0.5
        tensors["base_model.model.lm_head.lora_A.weight"] = a.to(dtype).cpu()
        tensors["base_model.model.lm_head.lora_B.weight"] = b.to(dtype).cpu()
        targets.append("lm_head")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "base_model_name_or_path": base_model_name,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": dora_magnitude is not None,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
