"""loraplex: one shared base model, many tenants with hot-swappable LoRA adapters.

The public names below are imported on first use, so `import loraplex.kernels...` (or any
other part) loads no engine, torch model code or tokenizer it does not need."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.adapters.request import LoRARequest
    from loraplex.platform.core.outputs import CompletionOutput, Logprob, RequestOutput
    from loraplex.platform.core.sampling_params import RequestOutputKind, SamplingParams
    from loraplex.platform.core.structured_outputs import StructuredOutputs
    from loraplex.platform.engine.llm import LLM

_EXPORTS = {
    "LLM": "loraplex.platform.engine.llm",
    "LoRARequest": "loraplex.adapters.request",
    "StructuredOutputs": "loraplex.platform.core.structured_outputs",
    "CompletionOutput": "loraplex.platform.core.outputs",
    "Logprob": "loraplex.platform.core.outputs",
    "RequestOutput": "loraplex.platform.core.outputs",
    "RequestOutputKind": "loraplex.platform.core.sampling_params",
    "SamplingParams": "loraplex.platform.core.sampling_params",
}

__all__ = [
    "LLM",
    "LoRARequest",
    "StructuredOutputs",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
