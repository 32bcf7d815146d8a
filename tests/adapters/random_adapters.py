"""A tiny random Llama beside the embedded model's tokenizer, and random PEFT adapters for it
written directly (no PEFT, no base model load): an engine on it steps in milliseconds, so a test
can drive dozens of adapters through it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, content_digest
from loraplex.platform.core.commands import AddAdapter

_BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


TINY_CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip


def write_tiny_model(folder: Path, source: Path) -> Path:
    """A random Llama of `TINY_CONFIG`'s size with the tokenizer of the model in `source`.

    Its weights are drawn wide (std 0.5, norms 1), so greedy choices are far from ties and an
    adapter's delta changes them."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.update(TINY_CONFIG, tie_word_embeddings=True)
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    shapes = module_shapes(config)
    hidden = config["hidden_size"]
    tensors = {
        "model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen) * 0.5,
        "model.norm.weight": torch.ones(hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, (n_in, n_out) in shapes.items():
            weight = torch.randn(n_out, n_in, generator=gen) * 0.5 / n_in**0.5
            tensors[f"{prefix}.{_BLOCKS[name]}.{name}.weight"] = weight
    save_file(tensors, str(folder / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    return folder


def module_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of every LoRA-capable projection of a Llama-family config."""
    hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, hf_config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}  # fmt: skip


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
