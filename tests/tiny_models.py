"""The test suite's tiny random Llama, built one way.

`tiny_llama_config(**sizes)` is the one config every tiny model starts from; a test that needs
other sizes or ids says which with keyword overrides. From it:

- `write_tiny_config(path)`: the config alone; loraplex draws random weights when it loads a
  `.json` model (seeded, so two engines on it hold the same weights);
- `write_tiny_llama(folder, source)`: a folder with random weights written out and the tokenizer
  of the model in `source`, so text prompts, chat templates and adapters' tokenizers work; its
  weights are drawn wide (std 0.5, norms 1), so greedy choices are far from ties and an
  adapter's delta changes them (the root conftest's session fixture `tiny_llama_dir` holds one
  on the embedded model's tokenizer);
- `tiny_hf_llama(seed)`: the transformers model of the config, for PEFT to wrap and save.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# The sizes `write_tiny_llama` gives the model of its tokenizer's vocabulary: a few layers wide
# enough that adapters of every form (DoRA, embeddings, lm_head) have room to act.
WITH_TOKENIZER = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
_BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    """A Hugging Face config.json of the tiny Llama, `overrides` replacing its values."""
    return {**TINY_LLAMA, **overrides}


def write_tiny_config(path: Path, **overrides: Any) -> Path:
    """`tiny_llama_config(**overrides)` written to `path` (a `.json` file)."""
    path.write_text(json.dumps(tiny_llama_config(**overrides)))
    return path


def module_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of every LoRA-capable projection of a Llama-family config."""
    hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, hf_config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}  # fmt: skip


def write_tiny_llama(folder: Path, source: Path, **overrides: Any) -> Path:
    """A random Llama of `WITH_TOKENIZER`'s sizes (with `overrides`) in `folder`, taking the
    vocabulary, special ids and tokenizer of the model in `source`; returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.update(WITH_TOKENIZER, tie_word_embeddings=True, **overrides)
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    hidden = config["hidden_size"]
    tensors = {
        "model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen) * 0.5,
        "model.norm.weight": torch.ones(hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, (n_in, n_out) in module_shapes(config).items():
            weight = torch.randn(n_out, n_in, generator=gen) * 0.5 / n_in**0.5
            tensors[f"{prefix}.{_BLOCKS[name]}.{name}.weight"] = weight
    save_file(tensors, str(folder / "model.safetensors"))
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    return folder


def tiny_hf_llama(seed: int = 0, **overrides: Any):
    """transformers' LlamaForCausalLM of `tiny_llama_config(**overrides)`, its weights drawn
    from `seed`, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {k: v for k, v in tiny_llama_config(**overrides).items() if k != "architectures"}
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()
