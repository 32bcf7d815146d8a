"""`AdapterValidator`: the checks every adapter passes, as a plain value any process may hold.

The engine publishes one at start-up (`Engine.adapter_validator`): the API validates an upload
with it off the event loop and off the engine thread, before any command reaches the engine,
and the engine's loader runs the same checks when it reads the adapter later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from loraplex.adapters.peft_format import BaseModelSpec, LoRAWeights, load_peft_adapter


@dataclass(frozen=True)
class AdapterValidator:
    """What an adapter must fit: the base model's spec, `max_lora_rank`, the serving dtype,
    whether slots for full embed_tokens / lm_head copies exist (`max_saved_module_loras`), and
    the base tokenizer an adapter's own tokenizer must agree with (`adapter_tokenizer`)."""

    spec: BaseModelSpec
    max_lora_rank: int
    dtype: str  # the serving dtype's torch name, e.g. "bfloat16"
    max_saved_module_loras: int = 0
    base_tokenizer: str = ""  # the folder of the base model's tokenizer.json ("": none)

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype must name a torch dtype, got {self.dtype!r}")

    def validate(self, path: str | os.PathLike[str]) -> LoRAWeights:
        """Load and validate a PEFT folder (fp32 tensors come back); any thread may call it.

        Raises `AdapterValidationError` naming the field, tensor or module at fault."""
        return load_peft_adapter(
            path,
            self.spec,
            self.max_lora_rank,
            getattr(torch, self.dtype),
            self.max_saved_module_loras,
            self.base_tokenizer,
        )
