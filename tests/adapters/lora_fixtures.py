"""Tiny random Llama models (the suite's tiny Llama, `tests.tiny_models`, with an MLP of 96 and a
vocabulary of 128) and PEFT adapters made on the spot (fp32, CPU), for adapter tests; a wait for
the adapter loader's reads, and the names a manager has registered."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from loraplex.adapters.loader import AdapterLoader
from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.slot_admission import SlotAdmission
from tests.tiny_models import tiny_hf_llama, tiny_llama_config

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HF_CONFIG = tiny_llama_config(intermediate_size=96, vocab_size=128)


def tiny_llama(seed: int = 0, **overrides: int):
    """The transformers model of `HF_CONFIG` (with `overrides`), its weights drawn from `seed`."""
    return tiny_hf_llama(seed, **{**HF_CONFIG, **overrides})


def make_peft_adapter(
    folder: Path, seed: int = 1, model_overrides: dict | None = None, **lora_kwargs
) -> Path:
    """Save a PEFT LoRA adapter (non-zero B) for a tiny Llama into `folder`."""
    from peft import LoraConfig, get_peft_model

    options = {"r": 4, "lora_alpha": 8, "target_modules": ALL_MODULES}
    options.update(lora_kwargs)
    base = tiny_llama(**(model_overrides or {}))
    torch.manual_seed(seed)  # the LoRA weights differ by seed; the base model never does
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **options))
    model.save_pretrained(str(folder))
    return folder


def finish_reads(admission: SlotAdmission, loader: AdapterLoader, timeout_s: float = 60) -> None:
    """Poll, as the engine does between steps, until the loader has no read under way."""
    deadline = time.monotonic() + timeout_s
    while loader.num_in_flight:
        assert time.monotonic() < deadline, "the adapter reads did not finish"
        loader.wait(deadline - time.monotonic())
        admission.poll()


def registered_adapters(manager: LoRAManager) -> dict[str, str]:
    """Registered names and their keys, as `GetAdapterStats` reports them."""
    return {a.name: a.key for a in manager.stats_report().adapters if a.registered}
