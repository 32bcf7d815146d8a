"""A tiny Llama whose vocabulary is padded past its tokenizer (the embedded model's), and a PEFT
adapter that adds a token in the first free row, trains that row (`trainable_token_indices`)
and saves its tokenizer beside it, as users do after `tokenizer.add_tokens(...)`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.tiny_models import write_tiny_llama

NEW_TOKEN = "<|tool|>"
PADDING = 64  # embedding rows past the base tokenizer's last id


def padded_tiny_model(folder: Path, model_dir: Path) -> tuple[Path, int]:
    """(a random tiny Llama with the embedded model's tokenizer and `PADDING` rows more than
    it, the id the first added token gets)."""
    source = folder / "source"
    source.mkdir(parents=True)
    config = json.loads((model_dir / "config.json").read_text())
    base_ids = config["vocab_size"]
    config["vocab_size"] = base_ids + PADDING
    (source / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, source / name)
    return write_tiny_llama(folder / "tiny", source), base_ids


def added_token_specs(new_id: int) -> dict[str, dict]:
    """`PeftReference` specs of the adapter: LoRA on q_proj and the new token's row trained."""
    return {"added": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                      "trainable_token_indices": [new_id]}}  # fmt: skip


def save_adapter_tokenizer(model: Path, folder: Path, *tokens: str) -> list[int]:
    """The base tokenizer with `tokens` added (default `NEW_TOKEN`), saved into the adapter's
    folder by transformers; returns their ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tokenizer.add_tokens(list(tokens or (NEW_TOKEN,)))
    tokenizer.save_pretrained(str(folder))
    return tokenizer.convert_tokens_to_ids(list(tokens or (NEW_TOKEN,)))


def trained_token_adapter(model: Path, folder: Path, new_id: int) -> Path:
    """A PEFT adapter (saved without the embedding) training row `new_id` beside LoRA on
    q_proj, with its own tokenizer holding `NEW_TOKEN` at `new_id`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    torch.manual_seed(3)
    peft = get_peft_model(
        base, LoraConfig(init_lora_weights=False, **added_token_specs(new_id)["added"])
    )
    with torch.no_grad():
        for module in peft.modules():
            for rows in (getattr(module, "trainable_tokens_delta", None) or {}).values():
                rows.add_(torch.randn(rows.shape))
    peft.save_pretrained(str(folder), save_embedding_layers=False)
    assert save_adapter_tokenizer(model, folder) == [new_id]
    return folder
