"""RequestAdmission: a caller's request checked, tokenized and queued as scheduler Requests.

Everything that can refuse a request does so here, before the scheduler sees it: an unknown or
disabled adapter, a prompt that does not fit the context, a structured-output spec that cannot
be compiled. A request with n samples becomes n scheduler Requests (`core_request_ids`), each
with its own seed, so every row of the device sampler draws counter-based noise.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.request import LoRARequest
from loraplex.config import EngineConfig
from loraplex.grammar.errors import GrammarError
from loraplex.platform.core.errors import PromptTooLongError
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.core.request import Request
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.engine.output_processor import OutputProcessor, core_request_ids
from loraplex.platform.engine.structured_output import StructuredOutputManager
from loraplex.platform.scheduler.scheduler import Scheduler
from loraplex.platform.tokenizer.adapter_tokenizers import AdapterTokenizers
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer, Tokenizer


class RequestAdmission:
    """Admits requests into one engine's scheduler, output processor and grammar manager."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        structured: StructuredOutputManager,
        adapter_tokenizers: AdapterTokenizers,
        lora_manager: LoRAManager | None,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        vocab_size: int,
        generation_defaults: GenerationDefaults,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.structured = structured
        self.adapter_tokenizers = adapter_tokenizers
        self.lora_manager = lora_manager
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.generation_defaults = generation_defaults  # a missing max_tokens' default
        self._ids = itertools.count()
        # NOTE: a request without a seed gets one from here when it is added, so every row of
        # the device sampler draws counter-based noise, and a seeded engine (model.seed) gives
        # the same text for the same requests in the same order.
        self._seeds = random.Random(config.model.seed)
        self.prompt_tokens_total = 0

    def add(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        prompt_token_ids: list[int] | None,
        tenant: str,
        lora_request: LoRARequest | None,
    ) -> str:
        """Queue a request; returns its id (a fresh one for None). The errors it raises are
        `EngineClient.add_request`'s."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        adapter_key = self._adapter_key(lora_request)  # NOTE: validates its tokenizer first
        encodes = prompt_token_ids is None and isinstance(prompt, str)
        tokenizer = self._tokenizer_for(lora_request, params, encodes)
        token_ids = self.tokenize(
            prompt_token_ids if prompt_token_ids is not None else prompt, tokenizer
        )
        if not token_ids:
            raise ValueError("the prompt is empty")
        max_tokens = self._check_length(len(token_ids), params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.submit(params.structured_outputs)
        core_ids = core_request_ids(request_id, params.n)
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params, core_ids,
            tokenizer,
        )  # fmt: skip
        for index, core_id in enumerate(core_ids):
            child = params if params.n == 1 else params.for_child(index)
            if child.seed is None:
                child = replace(child, seed=self._seeds.getrandbits(63))
            request = Request(
                core_id,
                token_ids,
                child,
                self.eos_token_ids,
                max_tokens=max_tokens,
                tenant=tenant,
                lora_request=lora_request,
                adapter_key=adapter_key,
            )
            if grammar is not None:
                # NOTE: its masks are filled while the device runs the step's forward pass, so
                # it runs ahead like any request; `GrammarConfig.overlap=False` locks the step.
                request.async_ok = self.config.grammar.overlap
                self.structured.add_request(request, grammar)
            self.scheduler.add_request(request)
        self.prompt_tokens_total += len(token_ids)
        return request_id

    def tokenize(
        self,
        prompt: str | list[int],
        tokenizer: Tokenizer | TokenIdsOnlyTokenizer | None = None,
    ) -> list[int]:
        """A text prompt's token ids (the base tokenizer's unless one is given), or client
        token ids checked against the vocabulary (ValueError)."""
        if isinstance(prompt, str):
            return (tokenizer or self.adapter_tokenizers.base).encode(prompt)
        ids = list(prompt)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def _tokenizer_for(
        self, lora_request: LoRARequest | None, params: SamplingParams, encodes: bool
    ) -> Tokenizer | TokenIdsOnlyTokenizer:
        """The tokenizer of a request: its adapter's own, else the base's. Grammar requests
        on an adapter with its own tokenizer are refused (grammar vocabularies are the base
        tokenizer's). The EngineCore (no text here) loads one only to encode a text prompt,
        and looks for one only for such a prompt or a grammar request."""
        needs_text = self.output_processor.detokenize or encodes
        grammar = params.structured_outputs is not None
        if not (needs_text or grammar) or not self.adapter_tokenizers.has_own(lora_request):
            return self.adapter_tokenizers.base
        if grammar:
            raise GrammarError(
                "Structured output (response_format, guided decoding, tool_choice 'required' "
                "or named) is not available on an adapter that has its own tokenizer: its "
                "grammars are compiled for the base model's tokenizer."
            )
        return self.adapter_tokenizers.get(lora_request)

    def _adapter_key(self, lora_request: LoRARequest | None) -> str | None:
        if lora_request is None:
            return None
        if self.lora_manager is None:
            raise ValueError("LoRA adapters are disabled on this engine (enable_lora=False)")
        return self.lora_manager.adapter_key(lora_request)

    def _check_length(self, num_prompt: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{num_prompt} tokens. Please shorten the prompt."
            )
        if params.max_tokens is None:
            return self.generation_defaults.max_tokens_for(None, num_prompt, limit)
        if num_prompt + params.max_tokens > limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or "
                "max_tokens.",
                param="max_tokens",
            )
        return params.max_tokens
