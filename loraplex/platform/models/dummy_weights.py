"""Random weights for a real architecture, generated on the device from a seed.

Each parameter draws from its own generator seeded by (seed, parameter name), so the same
seed gives the same weights whatever the device order, and a baseline (HF transformers) can be
handed the very same tensors through `hf_state_dict`.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from loraplex.platform.models.linear import Linear

_STD = 0.02


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            raise ValueError(f"random weights need an unquantized model ({name} is {param.dtype})")
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        param.normal_(0.0, _STD, generator=gen)


@torch.no_grad()
def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names, merged layers split back (views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    renames = {v: k for k, v in getattr(model, "checkpoint_renames", {}).items()}
    for module_path, module in model.named_modules():
        if isinstance(module, Linear):
            base = module_path.rpartition(".")[0]
            offsets = module.shard_offsets()
            for i, shard in enumerate(module.shard_names):
                out[f"model.{base}.{shard}.weight"] = module.weight[offsets[i] : offsets[i + 1]]
                if module.bias is not None:
                    out[f"model.{base}.{shard}.bias"] = module.bias[offsets[i] : offsets[i + 1]]
            continue
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_path}.{pname}" if module_path else pname
            out[renames.get(full, f"model.{full}")] = param
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out
