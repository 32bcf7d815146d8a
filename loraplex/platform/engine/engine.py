"""Engine: add requests, step the batch, abort — the offline core under LLM and the engine loop.

The Engine builds its parts (runner, scheduler, adapter manager, grammar manager, output
processor) and runs the step pipeline over them; admitting requests (`admission.py`), engine
commands (`engine_commands.py`) and what is polled between steps (`polling.py`) live beside it.
It is not thread-safe: one thread at a time calls it (the offline `LLM`, or `EngineLoop`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path

from loraplex.adapters.manager import LoRAManager
from loraplex.adapters.peft_format import BaseModelSpec
from loraplex.adapters.request import LoRARequest
from loraplex.config import EngineConfig
from loraplex.platform.core.commands import EngineCommand
from loraplex.platform.core.outputs import RequestOutput, StopHit
from loraplex.platform.core.request import RequestStatus
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from loraplex.platform.core.spec_stats import SpecDecodingStats
from loraplex.platform.core.stats import EngineStats
from loraplex.platform.engine.admission import RequestAdmission
from loraplex.platform.engine.engine_commands import handle_command
from loraplex.platform.engine.gc_tuning import tune_for_serving
from loraplex.platform.engine.output_processor import OutputProcessor
from loraplex.platform.engine.polling import poll_adapters, poll_grammars
from loraplex.platform.engine.structured_output import StepBitmask, StructuredOutputManager
from loraplex.platform.models.arch_config import ArchConfig
from loraplex.platform.models.generation_config import read_generation_defaults
from loraplex.platform.models.model_loader import generation_eos_ids
from loraplex.platform.models.model_store import resolve_model_path
from loraplex.platform.runner.model_runner import LaunchedStep, ModelRunner, StepOutput
from loraplex.platform.scheduler.kv_cache_manager import PrefixCacheStats
from loraplex.platform.scheduler.scheduler import Scheduler
from loraplex.platform.spec.proposer import can_speculate
from loraplex.platform.tokenizer.adapter_tokenizers import AdapterTokenizers
from loraplex.platform.tokenizer.tokenizer import (
    TokenIdsOnlyTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_folder,
)

logger = logging.getLogger(__name__)


def eos_token_ids(
    model_dir: Path, arch: ArchConfig, tokenizer: Tokenizer | TokenIdsOnlyTokenizer
) -> tuple[int, ...]:
    """The ids that end generation: the model's generation config's, and the tokenizer's."""
    eos = generation_eos_ids(model_dir, arch)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos = (tokenizer.eos_token_id, *eos)
    return eos


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
        arch = ArchConfig.from_path(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir, arch.vocab_size)
        self.adapter_tokenizers = AdapterTokenizers(self.tokenizer)
        self.eos_token_ids = eos_token_ids(self.model_dir, arch, self.tokenizer)
        self.runner = ModelRunner(config, self.model_dir, self.eos_token_ids)
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
            self.eos_token_ids,
            arch.vocab_size,
            config.scheduler.max_num_seqs,
            config.grammar,
            pin_memory=self.runner.device.type == "cuda",
        )
        self.output_processor = OutputProcessor(self.tokenizer, detokenize)
        self.admission = RequestAdmission(
            config,
            self.scheduler,
            self.output_processor,
            self.structured,
            self.adapter_tokenizers,
            self.lora_manager,
            self.eos_token_ids,
            self.max_model_len,
            arch.vocab_size,
            self.generation_defaults,
        )
        tune_for_serving()  # NOTE: thousands of short-lived objects a step (see gc_tuning)
        self.served_model_name = config.model.served_model_name or self.model_dir.stem
        self.generation_tokens_total = 0
        async_scheduling = config.scheduler.async_scheduling
        if async_scheduling is None:
            async_scheduling = self.runner.device.type == "cuda"
        self.async_scheduling = async_scheduling
        # The launched step whose output is not processed yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, StepOutput] | None = None

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

    # -- requests in and out -------------------------------------------------------------

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
        """Queue a request; returns its id (a fresh one for None). Refusals are those of
        `EngineClient.add_request` (ValueError and its kinds); a request on an adapter that
        stores its own tokenizer is tokenized and detokenized with it."""
        return self.admission.add(
            request_id, prompt, params, prompt_token_ids, tenant, lora_request
        )

    def tokenize(
        self,
        prompt: str | list[int],
        tokenizer: Tokenizer | TokenIdsOnlyTokenizer | None = None,
    ) -> list[int]:
        return self.admission.tokenize(prompt, tokenizer)

    @property
    def prompt_tokens_total(self) -> int:
        return self.admission.prompt_tokens_total

    def handle_command(self, command: EngineCommand) -> object:
        """Run an engine command (`engine_commands.handle_command`); call it on the thread
        that steps this engine, between steps."""
        return handle_command(self, command)

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

    def stop_samples(self, hits: Iterable[StopHit]) -> list[RequestOutput]:
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

    def end_all_requests(self, request_ids: Iterable[str]) -> None:
        """After a step raised: end every request the engine holds and those of `request_ids`,
        through the scheduler (blocks and adapter slots freed, the runner told to forget
        them) and the output processor. The engine then serves new requests as before.

        NOTE: a step can raise midway through scheduling or updating, so which requests it
        touched is unknown: all of them end, including any no caller is waiting for."""
        ended = set(request_ids)
        for core_id in self.scheduler.requests:
            parent_id = self.output_processor.parent_of(core_id)
            if parent_id is not None:
                ended.add(parent_id)
        self.scheduler.finish_all_requests(RequestStatus.FINISHED_ABORTED)
        for request_id in ended:
            try:
                self.abort_request(request_id)
            except Exception:
                logger.exception("ending request %s after a failed step failed", request_id)

    def progress(self, request_id: str) -> tuple[tuple[int, int], ...]:
        """The request's samples' (computed tokens, output tokens): what the watchdog watches."""
        requests = self.scheduler.requests
        core = (requests.get(i) for i in self.output_processor.core_ids(request_id))
        return tuple((r.num_computed_tokens, r.num_output_tokens) for r in core if r)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    @property
    def has_step_in_flight(self) -> bool:
        """A launched step's output is not processed yet (async scheduling)."""
        return self._in_flight is not None

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
        failed = poll_grammars(self) + poll_adapters(self)
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
        self.scheduler.update_draft_token_ids(self.runner.propose(asks))

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

    def _grammar_bitmask(self, launched: LaunchedStep) -> StepBitmask | None:
        """Fill the masks of the launched step's constrained rows. Every token sampled before
        this step has been accepted by its matcher by now (in lock step before the launch,
        under async scheduling just before this call)."""
        requests = self.structured.active_requests()
        if not requests:
            return None
        logits_rows = self.runner.logits_rows(
            launched, (r.request_id for r in requests), len(requests)
        )
        return self.structured.fill_bitmask(requests, logits_rows)

    # -- the rest ------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.structured.shutdown()
        if self.lora_manager is not None:
            self.lora_manager.shutdown()
        self.runner.shutdown()

    def reset_counters(self) -> None:
        """Forget what was served so far (a warm-up burst): the cached prefixes, and the token,
        preemption, prefix-cache and speculation counters. Call while no request runs."""
        self.scheduler.kv.reset_prefix_cache()
        self.scheduler.kv.stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0
        self.scheduler.spec_stats = SpecDecodingStats()
        self.admission.prompt_tokens_total = 0
        self.generation_tokens_total = 0

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
