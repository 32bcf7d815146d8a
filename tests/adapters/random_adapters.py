"""Random PEFT adapters for the tiny Llama (`tests.tiny_models.write_tiny_llama`), written
directly (no PEFT, no base model load): an engine on it steps in milliseconds, so a test can
drive dozens of adapters through it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, content_digest
from loraplex.platform.core.commands import AddAdapter
from tests.tiny_models import module_shapes

_BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def write_adapter(
    folder: Path,
    hf_config: dict,
    seed: int,
    r: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
    scale: float = 1.0,
) -> Path:
    """A PEFT folder with random A and B (B large enough to change greedy text soon)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for name in targets:
            n_in, n_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{_BLOCKS[name]}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, n_in, generator=gen) / n_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, r, generator=gen) * scale
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets),
              "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    return folder


def add_command(name: str, folder: Path, **kwargs: object) -> AddAdapter:
    """The `AddAdapter` the API would send for a stored folder: with its content digest."""
    digest = content_digest(
        (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    )
    return AddAdapter(name, str(folder), digest, **kwargs)  # type: ignore[arg-type]
