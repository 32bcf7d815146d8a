"""Engine: add requests, step the batch, abort — the offline core under LLM and the server."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from loraplex.adapters.errors import AdapterLoadError
from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.peft_format import BaseModelSpec
from loraplex.adapters.request import LoRARequest
from loraplex.config import EngineConfig
from loraplex.grammar.errors import GrammarError
from loraplex.platform.core.commands import (
    AddAdapter,
    EngineCommand,
    GetAdapterStats,
    PinAdapter,
    RemoveAdapter,
    SetTenantWeight,
)
from loraplex.platform.core.errors import PromptTooLongError
from loraplex.platform.core.outputs import RequestOutput, StopHit
from loraplex.platform.core.request import Request, RequestStatus
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from loraplex.platform.core.stats import EngineStats
from loraplex.platform.engine.adapter_tokenizers import AdapterTokenizers
from loraplex.platform.engine.gc_tuning import tune_for_serving
from loraplex.platform.engine.output_processor import OutputProcessor, core_request_ids
from loraplex.platform.engine.structured_output import StepBitmask, StructuredOutputManager
from loraplex.platform.models.generation_config import read_generation_defaults
from loraplex.platform.models.model_loader import generation_eos_ids
from loraplex.platform.models.model_store import resolve_model_path
from loraplex.platform.models.tokenizer import (
    TokenIdsOnlyTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_folder,
)
from loraplex.platform.runner.model_runner import LaunchedStep, ModelRunner, StepOutput
from loraplex.platform.scheduler.scheduler import Scheduler
from loraplex.platform.spec.proposer import can_speculate

logger = logging.getLogger(__name__)


class Engine:
    """`detokenize=False` (the EngineCore process): outputs carry token ids and logprob values
    but no text, and stop strings are matched by the caller, which ends a sample that matched
    one with `stop_samples`."""

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        self.config = config
        self.model_dir = resolve_model_path(config.model.model)
        # A request's default sampling parameters (its own values win): vLLM's generation config
        self.generation_defaults = read_generation_defaults(
            self.model_dir, config.model.generation_config, config.model.generation_overrides
        )
        self.runner = ModelRunner(config, self.model_dir, ())
        arch = self.runner.arch
        self.tokenizer = load_tokenizer(self.model_dir, arch.vocab_size)
        self.adapter_tokenizers = AdapterTokenizers(self.tokenizer)
        eos = generation_eos_ids(self.model_dir, arch)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos = (self.tokenizer.eos_token_id, *eos)
        self.eos_token_ids = eos
        self.runner.eos_token_ids = eos
        self.max_model_len = self.runner.max_model_len
        self.lora_manager = self._build_lora_manager()
        # Set once, read-only: the API validates uploads with it before adding them.
        self.adapter_validator = self.lora_manager.validator if self.lora_manager else None
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.runner.num_blocks,
            self.max_model_len,
            adapters=None if self.lora_manager is None else self.lora_manager.admission,
        )
        self.structured = StructuredOutputManager(
            self.tokenizer,
            eos,
            arch.vocab_size,
            config.scheduler.max_num_seqs,
            config.grammar,
            pin_memory=self.runner.device.type == "cuda",
        )
        self.output_processor = OutputProcessor(self.tokenizer, detokenize)
        tune_for_serving()  # NOTE: thousands of short-lived objects a step (see gc_tuning)
        self.served_model_name = config.model.served_model_name or self.model_dir.stem
        self._ids = itertools.count()
        # NOTE: a request without a seed gets one from here when it is added, so every row of
        # the device sampler draws counter-based noise, and a seeded engine (model.seed) gives
        # the same text for the same requests in the same order.
        self._seeds = random.Random(config.model.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        async_scheduling = config.scheduler.async_scheduling
        if async_scheduling is None:
            async_scheduling = self.runner.device.type == "cuda"
        self.async_scheduling = async_scheduling
        # The launched step whose output is not processed yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, StepOutput] | None = None

    # -- requests ------------------------------------------------------------------------

    def tokenize(
        self,
        prompt: str | list[int],
        tokenizer: Tokenizer | TokenIdsOnlyTokenizer | None = None,
    ) -> list[int]:
        if isinstance(prompt, str):
            return (tokenizer or self.tokenizer).encode(prompt)
        ids = list(prompt)
        vocab = self.runner.arch.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        prompt_token_ids: list[int] | None = None,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a request; returns its id.

        Raises ValueError for prompts that cannot fit, adapters that cannot be served
        (`AdapterValidationError`) and structured-output specs that cannot be compiled
        (`GrammarError`, also for a request on an adapter with its own tokenizer).

        A request on an adapter that stores its own tokenizer is tokenized and detokenized
        with it (`AdapterTokenizers`)."""
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
            return self.tokenizer
        if grammar:
            raise GrammarError(
                "Structured output (response_format, guided decoding, tool_choice 'required' "
                "or named) is not available on an adapter that has its own tokenizer: its "
                "grammars are compiled for the base model's tokenizer."
            )
        return self.adapter_tokenizers.get(lora_request)

    def _build_lora_manager(self) -> LoRAManager | None:
        """The engine's adapter manager, the one owner of adapters: over the runner's LoRA
        layers, reading adapters on its loader thread."""
        state = self.runner.lora_state
        if state is None:
            return None
        spec = BaseModelSpec.from_hf_config(self.runner.arch.raw, name_or_path=str(self.model_dir))
        base_tokenizer = tokenizer_folder(self.model_dir)
        return LoRAManager(
            self.config.lora, spec, state, self.runner.dtype,
            base_tokenizer=str(base_tokenizer or ""),
        )  # fmt: skip

    # -- commands --------------------------------------------------------------------------

    def handle_command(self, command: EngineCommand) -> object:
        """Run an adapter or tenant command (`loraplex.platform.core.commands`, which lists
        each command's result); call it on the thread that steps this engine, between steps.

        Raises ValueError for a command the engine refuses (LoRA disabled, pinning every slot)
        and `AdapterValidationError` for an adapter that cannot be served."""
        if isinstance(command, SetTenantWeight):
            self.scheduler.waiting.weights[command.tenant] = float(command.weight)
            return None
        manager = self.lora_manager
        if isinstance(command, GetAdapterStats):
            if manager is None:
                raise ValueError("LoRA adapters are disabled on this engine (enable_lora=False)")
            waiting = Counter(
                r.adapter_key
                for r in self.scheduler.requests.values()
                if r.adapter_key is not None and r.status != RequestStatus.RUNNING
            )
            return manager.stats_report(waiting)
        if manager is None:
            if isinstance(command, RemoveAdapter):
                return False
            raise ValueError("LoRA adapters are disabled on this engine (enable_lora=False)")
        if isinstance(command, AddAdapter):
            return manager.register(command)
        if isinstance(command, RemoveAdapter):
            return manager.remove_adapter(command.name)
        if isinstance(command, PinAdapter):
            return manager.pin(command.name, command.pinned)
        raise ValueError(f"unknown engine command {command!r}")

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

    def abort_request(
        self, request_id: str, error: Exception | None = None
    ) -> RequestOutput | None:
        """End a request (freeing its blocks and adapter slot); returns its final output.

        With `error`, the request failed rather than being aborted: it finishes with reason
        "error" and the final output carries the error (`error`, `failure`)."""
        core_ids = self.output_processor.core_ids(request_id)
        for core_id in core_ids:
            self.structured.forget(core_id)
        if error is None:
            self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_ABORTED)
            return self.output_processor.abort(request_id)
        self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_ERROR)
        out = self.output_processor.abort(request_id, "error")
        if out is not None:
            out.error, out.failure = str(error), error
        return out

    def stop_samples(self, hits: list[StopHit]) -> list[RequestOutput]:
        """End samples whose text matched a stop string (found by the caller's detokenizer),
        freeing their blocks; returns the outputs of the requests they belong to (finish
        reason "stop", the tokens after `num_tokens` dropped from the counts)."""
        outputs = []
        for hit in hits:
            self.structured.forget(hit.core_id)
            self.scheduler.finish_requests([hit.core_id], RequestStatus.FINISHED_STOPPED)
            out = self.output_processor.stop(hit)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    # -- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs it produced.

        With async scheduling, step N+1 is scheduled and its forward pass launched before step
        N's sampled tokens are read, and this returns step N's outputs while the device runs
        step N+1. Penalties, min_tokens, logprobs and seeds read only device state, so they run
        ahead too. A grammar's mask is filled on the host from its accepted tokens: step N+1's
        masks are filled after step N's tokens are read, while the device computes step N+1's
        forward pass, and its sampling is launched after them.

        A speculative step needs step N's tokens before it is scheduled (its drafts continue
        them, and how many tokens a verification emitted moves every later position), so step
        N's tokens are read and the scheduler updated first; with async scheduling the rest of
        step N's processing (detokenizing, stop strings, outputs) still runs after step N+1 is
        launched, and step N+1 stays in flight while the caller handles step N's outputs."""
        failed = self._poll_grammars() + self._poll_adapters()
        speculate = self._speculating()
        overlap = self.async_scheduling and not self.scheduler.num_lock_step
        in_flight_drafts = self._in_flight is not None and bool(
            self._in_flight[0].scheduled_spec_decode_tokens
        )
        lock_step = not overlap or speculate or in_flight_drafts
        updated: list[EngineCoreOutput] = []
        if lock_step and self._in_flight is not None:
            (done_so, done_step), self._in_flight = self._in_flight, None
            updated = self._update(done_so, done_step)
        outputs = self._emit(updated) if not overlap else []
        if speculate:
            self._propose()
        so = self.scheduler.schedule()
        if so.new_reqs:  # NOTE: their queue time ends here (RequestTiming.queue_s)
            self.output_processor.mark_scheduled([r.req_id for r in so.new_reqs], time.monotonic())
        constrained = self.structured.num_active > 0
        launched = self.runner.launch(so, need_sampler=constrained)
        if not lock_step:
            outputs = self._finish_in_flight()
        elif overlap:
            outputs = self._emit(updated)  # NOTE: while the device runs the launched step
        bitmask = self._grammar_bitmask(launched) if constrained else None
        if bitmask is None:
            step = self.runner.sample(launched)
        else:
            step = self.runner.sample(launched, bitmask.bitmask, bitmask.rows)
        if not overlap or so.is_empty:  # nothing left in flight
            return failed + outputs + self._process(so, step)
        self._in_flight = (so, step)
        return failed + outputs

    def _speculating(self) -> bool:
        """Whether this step proposes drafts: a proposer is configured and fewer requests
        than `disable_by_batch_size` run or wait. A speculative step runs in lock step (its
        proposals read every request's latest tokens on the host)."""
        spec = self.config.speculative
        if spec is None or not self.scheduler.num_running:
            return False
        limit = spec.disable_by_batch_size
        return limit is None or self.scheduler.num_running + self.scheduler.num_waiting < limit

    def _propose(self) -> None:
        """Draft tokens for the running requests that decode and may speculate."""
        spec = self.config.speculative
        assert spec is not None
        asks: list[tuple[str, int]] = []
        for request in self.scheduler.running:
            request.spec_token_ids = []
            if (
                request.grammar is None
                and request.num_computed_tokens == request.num_tokens - 1
                and not request.num_pending
                and can_speculate(request.sampling_params)
            ):
                k = min(
                    spec.num_speculative_tokens,
                    request.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens,
                )
                if k > 0:
                    asks.append((request.request_id, k))
        drafts = self.runner.propose(asks)
        if drafts:
            for request in self.scheduler.running:
                request.spec_token_ids = drafts.get(request.request_id, [])

    def _finish_in_flight(self) -> list[RequestOutput]:
        if self._in_flight is None:
            return []
        (so, step), self._in_flight = self._in_flight, None
        return self._process(so, step)

    def _process(self, so: SchedulerOutput, step: StepOutput) -> list[RequestOutput]:
        return self._emit(self._update(so, step))

    def _update(self, so: SchedulerOutput, step: StepOutput) -> list[EngineCoreOutput]:
        """Read a step's tokens (waiting for the device) and give them to the scheduler."""
        runner_out = step.get()
        if runner_out.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(runner_out.prompt_logprobs)
        core_outputs = self.scheduler.update_from_output(so, runner_out)
        self.generation_tokens_total += sum(len(o.new_token_ids) for o in core_outputs)
        return core_outputs

    def _emit(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Detokenize a step's new tokens into outputs; end the requests a stop string hit."""
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            # NOTE: the stop-string hit was already recorded on the sample; freeing the core
            # request here only releases its blocks.
            self.scheduler.finish_requests(
                [hit.core_id for hit in stopped], RequestStatus.FINISHED_STOPPED
            )
        return outputs

    def _poll_grammars(self) -> list[RequestOutput]:
        """Start requests whose grammar compiled; end those whose compile failed."""
        structured = self.structured
        if (
            structured.num_waiting
            and not self.scheduler.num_running
            and self._in_flight is None
            and self.scheduler.num_waiting == structured.num_waiting
        ):
            # NOTE: every request waits for its grammar: wait a little for the compile threads
            # instead of spinning empty steps.
            structured.wait(0.01)
        outputs = []
        for request, error in self.structured.poll():
            parent_id = self.output_processor.parent_of(request.request_id)
            if parent_id is None:
                continue
            out = self.abort_request(parent_id)
            if out is not None:
                out.error = str(error)
                out.failure = error
                outputs.append(out)
        return outputs

    def _poll_adapters(self) -> list[RequestOutput]:
        """End, with the reason, the requests on adapters that failed to load since the last
        step; every other request carries on."""
        manager = self.lora_manager
        if manager is None:
            return []
        if (
            not self.scheduler.num_running
            and self._in_flight is None
            and self.scheduler.num_waiting
        ):
            # NOTE: nothing runs and requests wait (maybe for an adapter being read): wait a
            # little for the loader instead of spinning empty steps.
            manager.wait_for_loads(0.01)
        manager.poll()
        failures = manager.take_failures()
        if not failures:
            return []
        reasons: dict[str, str] = {}  # parent request id -> why
        for request in self.scheduler.requests.values():
            reason = failures.get(request.adapter_key)  # type: ignore[arg-type]
            parent_id = self.output_processor.parent_of(request.request_id)
            if reason is not None and parent_id is not None:
                reasons.setdefault(parent_id, reason)
        outputs = []
        for parent_id, reason in reasons.items():
            out = self.abort_request(parent_id, error=AdapterLoadError(reason))
            if out is not None:
                outputs.append(out)
        return outputs

    def _grammar_bitmask(self, launched: LaunchedStep) -> StepBitmask | None:
        """Fill the masks of the launched step's constrained rows. Every token sampled before
        this step has been accepted by its matcher by now (in lock step before the launch,
        under async scheduling just before this call)."""
        requests = self.structured.active_requests()
        if not requests:
            return None
        index = self.runner.input_batch.req_index
        batch_rows = np.fromiter(
            (index.get(r.request_id, -1) for r in requests), np.int64, len(requests)
        )
        logits_rows = np.where(batch_rows >= 0, launched.logits_rows(batch_rows), -1)
        return self.structured.fill_bitmask(requests, logits_rows)

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.lora_manager is not None:
            self.lora_manager.shutdown()
        self.runner.shutdown()

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            kv_usage=kv.pool.usage,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            lora=self.lora_manager.stats() if self.lora_manager is not None else None,
            spec_decoding=(
                self.scheduler.spec_stats.snapshot() if self.config.speculative else None
            ),
        )

    def generate_blocking(self, deadline_s: float | None = None) -> list[RequestOutput]:
        """Step until every request has finished; returns the final outputs in finish order."""
        start = time.monotonic()
        done: list[RequestOutput] = []
        while self.has_unfinished_requests():
            done.extend(o for o in self.step() if o.finished)
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                raise TimeoutError(f"generation did not finish within {deadline_s} s")
        return done
