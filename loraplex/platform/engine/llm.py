"""LLM: the offline API in vLLM's shape (`generate`, `chat`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from loraplex.adapters.request import LoRARequest
from loraplex.config import EngineConfig
from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.core.sampling_params import RequestOutputKind, SamplingParams
from loraplex.platform.core.stats import EngineStats
from loraplex.platform.engine.engine import Engine

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Offline batched generation.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        quantization: str | None = None,
        seed: int = 0,
        device: str = "auto",
        gpu_memory_utilization: float = 0.9,
        max_loras: int = 8,
        max_lora_rank: int = 64,
        max_cpu_loras: int = 32,
        max_saved_module_loras: int = 0,
        enforce_eager: bool = False,
        enable_lora: bool = True,
        async_scheduling: bool | None = None,
        grammar_overlap: bool = True,
        grammar_cold_start: bool = True,
        speculative_config: str | dict[str, Any] | None = None,
        tensor_parallel_size: int = 1,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
    ) -> None:
        config = EngineConfig.from_options(
            model=model, dtype=dtype, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
            quantization=quantization, seed=seed, device=device,
            gpu_memory_utilization=gpu_memory_utilization, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            max_saved_module_loras=max_saved_module_loras, enforce_eager=enforce_eager,
            async_scheduling=async_scheduling, grammar_overlap=grammar_overlap,
            grammar_cold_start=grammar_cold_start, speculative_config=speculative_config,
            tensor_parallel_size=tensor_parallel_size, generation_config=generation_config,
            override_generation_config=override_generation_config,
        )  # fmt: skip
        self.engine = Engine(config)

    def shutdown(self) -> None:
        """Stop the engine's helpers: grammar compiles, adapter loads, tensor-parallel ranks."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """Running / waiting requests, free and total KV blocks, prefix-cache counters."""
        return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order.

        `lora_request`: one adapter for every prompt, or a list with one per prompt (None =
        the base model)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._per_prompt(lora_request, len(prompts), "lora requests")
        return self._run([(p, None) for p in prompts], params_list, loras, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        loras = self._per_prompt(lora_request, len(conversations), "lora requests")
        items: list[tuple[Prompt, list[int] | None]] = []
        for conv, lora in zip(conversations, loras):
            # NOTE: an adapter with its own tokenizer renders through its own chat template
            tokenizer = self.engine.adapter_tokenizers.get(lora)
            ids = tokenizer.encode_chat(conv, add_generation_prompt=add_generation_prompt)
            items.append((tokenizer.decode(ids, skip_special_tokens=False), ids))
        params_list = self._params_per_prompt(sampling_params, len(items))
        return self._run(items, params_list, loras, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams (vLLM's name):
        the model's generation config (`generation_config`, `override_generation_config`)
        over SamplingParams' defaults."""
        return self.engine.generation_defaults.sampling_params()

    def _params_per_prompt(
        self, params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        return params

    @staticmethod
    def _per_prompt(value: Any, n: int, what: str) -> list:
        if value is None or not isinstance(value, (list, tuple)):
            return [value] * n
        if len(value) != n:
            raise ValueError(f"{len(value)} {what} for {n} prompts")
        return list(value)

    def _run(
        self,
        items: list[tuple[Prompt, list[int] | None]],
        params_list: list[SamplingParams],
        loras: list[LoRARequest | None],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for (prompt, token_ids), params, lora in zip(items, params_list, loras):
                params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(
                    engine.add_request(
                        None, prompt, params, prompt_token_ids=token_ids, lora_request=lora
                    )
                )
        except BaseException:
            for req_id in ids:
                engine.abort_request(req_id)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for req_id in ids:
                if req_id not in results:
                    engine.abort_request(req_id)
            raise
        finally:
            bar.close()
        failed = [results[i] for i in ids if results[i].error is not None]
        if failed:
            if isinstance(failed[0].failure, ValueError):  # e.g. the schema's GrammarError
                raise failed[0].failure
            raise ValueError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [results[i] for i in ids]
