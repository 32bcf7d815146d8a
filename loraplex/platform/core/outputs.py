"""What the engine hands back to callers: RequestOutput with one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Logprob(NamedTuple):
    """One token's logprob, its rank and text. NOTE: a NamedTuple, not a dataclass: a full
    batch asking for top-5 makes ~1,500 a step, and tuples of plain values are cheap to build
    and dropped from the garbage collector's scans (a frozen dataclass cost ~2x the step's
    host time in allocation and collection)."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


class StopHit(NamedTuple):
    """A sample that matched a stop string: its core request must stop generating."""

    core_id: str
    stop: str  # the stop string
    num_tokens: int  # the tokens it keeps (those after the one completing the string drop)


class RequestMetrics(NamedTuple):
    """When a request arrived, was first scheduled and produced its first token
    (`time.monotonic()` of the process that made the output), and how many tokens it has
    generated. NOTE: a NamedTuple, like
    `Logprob`: one is built per output per step."""

    arrival_time: float = 0.0
    first_token_time: float | None = None  # None until the first token
    num_generation_tokens: int = 0
    first_scheduled_time: float | None = None  # when it first entered a step (queue time ends)


# One dict per generated token: the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), then the prompt token's
# logprob and the top-k alternatives.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics = RequestMetrics()
    error: str | None = None  # why the request was ended early, e.g. its grammar failed
    failure: Exception | None = None  # the exception behind `error`, when one was raised
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta output of a request carrying `first`'s tokens then `later`'s: what a reader
    that fell behind by a step receives instead of two (fewer, larger stream events)."""
    samples = {sample.index: sample for sample in first.outputs}
    for sample in later.outputs:
        prev = samples.get(sample.index)
        if prev is None:
            samples[sample.index] = sample
            continue
        logprobs = None
        if prev.logprobs is not None or sample.logprobs is not None:
            logprobs = (prev.logprobs or []) + (sample.logprobs or [])
        samples[sample.index] = CompletionOutput(
            index=sample.index,
            text=prev.text + sample.text,
            token_ids=prev.token_ids + sample.token_ids,
            logprobs=logprobs,
            cumulative_logprob=(
                sample.cumulative_logprob
                if sample.cumulative_logprob is not None
                else prev.cumulative_logprob
            ),
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )
    return RequestOutput(
        request_id=later.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=[samples[i] for i in sorted(samples)],
        finished=later.finished,
        num_cached_tokens=later.num_cached_tokens,
        metrics=later.metrics,
        error=later.error,
        failure=later.failure,
        prompt_logprobs=first.prompt_logprobs or later.prompt_logprobs,
    )
