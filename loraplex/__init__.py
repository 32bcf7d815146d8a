"""loraplex: one shared base model, many tenants with hot-swappable LoRA adapters."""

from loraplex.adapters.request import LoRARequest
from loraplex.grammar.params import StructuredOutputs
from loraplex.platform.engine.llm import LLM
from loraplex.platform.engine.outputs import CompletionOutput, Logprob, RequestOutput
from loraplex.platform.engine.sampling_params import RequestOutputKind, SamplingParams

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
