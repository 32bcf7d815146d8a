"""Turns the scheduler's token outputs into RequestOutputs: detokenization, stop strings,
logprob decoding, and the merge of n > 1 samples into one output.

It runs where text is wanted: inside the Engine for the offline LLM and the in-process server;
in each API process for the EngineCore process, whose own OutputProcessor runs without text
(`detokenize=False`: token ids and logprob values only, see `ClientOutputs`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraplex.platform.core.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    StopHit,
)
from loraplex.platform.core.sampling_params import RequestOutputKind, SamplingParams
from loraplex.platform.core.scheduler_output import (
    EngineCoreOutput,
    PromptLogprobScores,
    TokenScores,
)
from loraplex.platform.tokenizer.detokenizer import IncrementalDetokenizer
from loraplex.platform.tokenizer.tokenizer import Tokenizer

_new_tuple = tuple.__new__


def core_request_ids(request_id: str, n: int) -> list[str]:
    """The engine-core request ids of a request's n samples."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class _NoText:
    """The detokenizer of an OutputProcessor without text: no text, no stop strings."""

    stop: tuple[str, ...] = ()
    text = ""

    def add_tokens(self, token_ids: list[int]) -> None:
        return None

    def take_delta(self, final: bool) -> str:
        return ""


_NO_TEXT = _NoText()


@dataclass(slots=True)
class _Sample:
    """One of a request's n samples (one engine-core request)."""

    index: int
    detokenizer: IncrementalDetokenizer | _NoText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    sent_tokens: int = 0  # token ids already handed out (DELTA mode)
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _Sample]  # core request id -> sample
    arrival: float
    tokenizer: Tokenizer  # the request's: its adapter's own, or the processor's
    kind: RequestOutputKind
    ordered: list[_Sample]  # the samples by index
    num_unfinished: int
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when its first sample first entered a step
    num_generated: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    sent_prompt_logprobs: bool = False  # DELTA mode hands them out once

    def finish(self, sample: _Sample, reason: str, stop_reason: int | str | None) -> None:
        """End `sample` (it was running) with `reason`."""
        sample.finish_reason, sample.stop_reason = reason, stop_reason
        self.num_unfinished -= 1


class OutputProcessor:
    """`detokenize=False`: outputs carry token ids and logprob values, no text (their
    `decoded_token` is ""), and stop strings are left to whoever detokenizes them."""

    def __init__(self, tokenizer: Tokenizer, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        # token id -> its text alone, for logprobs: a full batch asking for top-5 decodes
        # ~1,500 tokens a step, nearly all seen before (at most one entry per vocabulary id)
        self._token_text: dict[int, str] = {}
        self._parents: dict[str, _Parent] = {}
        self._core_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        core_ids: list[str] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        """Track a request; `core_ids`: its samples' engine-core ids (`core_request_ids`);
        `tokenizer`: the one its text comes from (None: the processor's, the base model's)."""
        tokenizer = tokenizer or self.tokenizer
        if core_ids is None:
            core_ids = core_request_ids(request_id, params.n)
        samples = {}
        for index, core_id in enumerate(core_ids):
            detok = _NO_TEXT
            if self.detokenize:
                detok = IncrementalDetokenizer(
                    tokenizer,
                    prompt_token_ids,
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                )
            samples[core_id] = _Sample(
                index, detok, logprobs=[] if params.logprobs is not None else None
            )
            self._core_to_parent[core_id] = request_id
        parent = _Parent(
            request_id, prompt, prompt_token_ids, params, samples, time.monotonic(), tokenizer,
            params.output_kind, list(samples.values()), len(samples),
        )  # fmt: skip
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self._parents[request_id] = parent

    def add_prompt_logprobs(self, scores: PromptLogprobScores) -> None:
        """Record scored prompt tokens (core request id -> (first position, entries)); a
        recomputed prompt (after preemption) overwrites the same positions."""
        for core_id, (first, entries) in scores.items():
            parent = self._parents.get(self._core_to_parent.get(core_id, ""))
            if parent is None or parent.prompt_logprobs is None:
                continue
            for pos, entry in enumerate(entries, start=first):
                parent.prompt_logprobs[pos] = self._decode_logprobs(entry, parent.tokenizer)

    def mark_scheduled(self, core_ids: list[str], now: float) -> None:
        """Record when requests were first scheduled (their queue time ends there)."""
        for core_id in core_ids:
            parent = self._parents.get(self._core_to_parent.get(core_id, ""))
            if parent is not None and parent.first_scheduled_time is None:
                parent.first_scheduled_time = now

    def core_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [] if parent is None else list(parent.samples)

    def parent_of(self, core_id: str) -> str | None:
        return self._core_to_parent.get(core_id)

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[StopHit]]:
        """Returns (outputs to hand out, the samples that hit a stop string while their core
        request still runs). Outputs of a sample that has finished are ignored."""
        touched: dict[str, _Parent] = {}
        stopped: list[StopHit] = []
        now = time.monotonic()
        core_to_parent, parents = self._core_to_parent, self._parents
        for out in outputs:
            parent_id = core_to_parent.get(out.req_id)
            if parent_id is None:
                continue
            parent = parents[parent_id]
            if self._add_step(
                parent, out.req_id, out.new_token_ids, out.new_logprobs, out.finish_reason,
                out.stop_reason, out.num_cached_tokens, now, stopped,
            ):  # fmt: skip
                touched[parent_id] = parent
        results = []
        for parent in touched.values():
            result = self._make_output(parent)
            if result is not None:
                results.append(result)
        return results, stopped

    def _add_step(
        self,
        parent: _Parent,
        core_id: str,
        token_ids: list[int],
        logprobs: TokenScores | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        num_cached_tokens: int,
        now: float,
        stopped: list[StopHit],
    ) -> bool:
        """One step of one sample: its new tokens (and their logprobs), how it finished, if it
        did; a stop string its text now holds ends it (recorded in `stopped` while its core
        request runs). -> whether the sample took it (False: it had finished already).

        NOTE: a core request that an API process stopped on a stop string runs on until the
        stop reaches the core: its later tokens are not part of the text."""
        sample = parent.samples[core_id]
        if sample.finish_reason is not None:
            return False
        if parent.first_token_time is None:
            parent.first_token_time = now
        if num_cached_tokens > parent.num_cached_tokens:
            parent.num_cached_tokens = num_cached_tokens
        new_ids, stop_str = self._detokenize(sample.detokenizer, token_ids)
        parent.num_generated += len(new_ids)
        sample.token_ids += new_ids
        if sample.logprobs is not None and logprobs is not None:
            sample.logprobs.append(self._decode_logprobs(logprobs, parent.tokenizer))
            sample.cumulative_logprob += logprobs[0][1]
        if stop_str is not None:
            parent.finish(sample, "stop", stop_str)
            if finish_reason is None:
                stopped.append(StopHit(core_id, stop_str, len(sample.token_ids)))
        elif finish_reason is not None:
            parent.finish(sample, finish_reason, stop_reason)
        return True

    @staticmethod
    def _detokenize(detokenizer, token_ids: list[int]) -> tuple[list[int], str | None]:
        """Add a step's tokens; returns those kept and the stop string found, if any. Several
        tokens (a speculative step's accepted run) go one at a time when stop strings are
        set, so the tokens after the one that completes a stop string are dropped, as they
        would never have been sampled without speculation."""
        if len(token_ids) == 1 or not detokenizer.stop:
            return token_ids, detokenizer.add_tokens(token_ids)
        for n, token in enumerate(token_ids, 1):
            stop_str = detokenizer.add_tokens([token])
            if stop_str is not None:
                return token_ids[:n], stop_str
        return token_ids, None

    def stop(self, hit: StopHit) -> RequestOutput | None:
        """Finish a sample that matched a stop string found elsewhere (an API process), keeping
        its first `hit.num_tokens` tokens; returns the request's output, None if the sample
        had already finished."""
        parent = self._parents.get(self._core_to_parent.get(hit.core_id, ""))
        if parent is None:
            return None
        sample = parent.samples[hit.core_id]
        if sample.finish_reason is not None:
            return None
        dropped = len(sample.token_ids) - hit.num_tokens
        if dropped > 0:
            parent.num_generated -= dropped
            del sample.token_ids[hit.num_tokens :]
            if sample.logprobs is not None:
                del sample.logprobs[hit.num_tokens :]
            sample.sent_tokens = min(sample.sent_tokens, hit.num_tokens)
            sample.sent_logprobs = min(sample.sent_logprobs, hit.num_tokens)
        parent.finish(sample, "stop", hit.stop)
        return self._make_output(parent)

    def abort(self, request_id: str, finish_reason: str = "abort") -> RequestOutput | None:
        """End a request's unfinished samples with `finish_reason` ("abort", or "error" for a
        request that failed); returns its final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for sample in parent.ordered:
            if sample.finish_reason is None:
                parent.finish(sample, finish_reason, None)
        return self._make_output(parent)

    def _decode_logprobs(
        self, entries: list[tuple[int, float, int]], tokenizer: Tokenizer
    ) -> dict[int, Logprob]:
        decoded: dict[int, Logprob] = {}
        # NOTE: the cache holds the base tokenizer's texts; an adapter's own decodes afresh
        texts = self._token_text if tokenizer is self.tokenizer else {}
        for token_id, logprob, rank in entries:
            if token_id not in decoded:
                text = texts.get(token_id)
                if text is None:
                    text = ""
                    if self.detokenize:
                        text = tokenizer.decode([token_id], skip_special_tokens=False)
                    texts[token_id] = text
                decoded[token_id] = Logprob(logprob, rank, text)
        return decoded

    def _make_output(self, parent: _Parent) -> RequestOutput | None:
        kind = parent.kind
        finished = not parent.num_unfinished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        delta = kind is RequestOutputKind.DELTA
        for sample in parent.ordered:
            done = sample.finish_reason is not None
            logprobs = sample.logprobs
            if delta:
                text = sample.detokenizer.take_delta(done)
                token_ids = sample.token_ids[sample.sent_tokens :]
                sample.sent_tokens = len(sample.token_ids)
                if logprobs is not None:
                    logprobs = logprobs[sample.sent_logprobs :]
                    sample.sent_logprobs = len(sample.logprobs)  # type: ignore[arg-type]
                if not text and not token_ids and not done:
                    continue
            else:
                text, token_ids = sample.detokenizer.text, list(sample.token_ids)
            completions.append(
                CompletionOutput(
                    sample.index,
                    text,
                    token_ids,
                    logprobs,
                    sample.cumulative_logprob if logprobs is not None else None,
                    sample.finish_reason,
                    sample.stop_reason,
                )
            )
        if not completions and not finished:
            return None
        # NOTE: built as tuple builds it: the NamedTuple's own __new__ is Python code, twice
        # the cost of the dict this replaced, once per output per step.
        metrics = _new_tuple(
            RequestMetrics,
            (
                parent.arrival,
                parent.first_token_time,
                parent.num_generated,
                parent.first_scheduled_time,
            ),
        )
        if finished:
            del self._parents[parent.request_id]
            for core_id in parent.samples:
                self._core_to_parent.pop(core_id, None)
        prompt_logprobs = parent.prompt_logprobs
        if delta:
            prompt_logprobs = None if parent.sent_prompt_logprobs else prompt_logprobs
            parent.sent_prompt_logprobs = True
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            completions,
            finished,
            parent.num_cached_tokens,
            metrics,
            None,
            None,
            prompt_logprobs,
        )
