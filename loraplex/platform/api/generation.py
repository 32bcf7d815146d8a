"""What chat and completions share: submitting prompts, merging their output streams, aborting
on client disconnect, accumulating deltas into choices, usage, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from loraplex.adapters.request import LoRARequest
from loraplex.platform.api.errors import (
    APIError,
    bad_request,
    engine_unavailable,
    from_engine_error,
    request_failed,
)
from loraplex.platform.api.logprobs import TokenLogprobs
from loraplex.platform.core.errors import EngineDeadError
from loraplex.platform.core.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.engine.protocol import EngineClient
from loraplex.platform.engine.request_stream import RequestStream

SSE_DONE = "data: [DONE]\n\n"

logger = logging.getLogger(__name__)


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_event(error: Exception) -> str:
    """The SSE event that ends a stream which failed after its 200 was sent."""
    if isinstance(error, APIError):
        return sse(error.body())
    if isinstance(error, EngineDeadError):
        return sse(engine_unavailable(error).body())
    logger.error("a stream failed", exc_info=error)
    return sse(APIError(500, "internal server error", type="internal_server_error").body())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


@dataclass(frozen=True)
class Prompt:
    """One prompt ready for the engine: its text (for echo) and its token ids."""

    text: str
    token_ids: list[int]
    from_client_ids: bool = False  # token ids sent by the client: the engine checks their range


async def submit(
    engine: EngineClient,
    prompts: list[Prompt],
    params: SamplingParams,
    request_id: str,
    tenant: str = "default",
    lora_request: LoRARequest | None = None,
) -> list[RequestStream]:
    """Add one engine request per prompt; if any is refused, abort the others and raise 4xx."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            # NOTE: ids we tokenized go in as they are; a client's ids go in as the prompt, so
            # that the engine checks every id against the vocabulary.
            stream = await engine.add_request(
                f"{request_id}-{i}",
                prompt.token_ids if prompt.from_client_ids else prompt.text,
                params,
                prompt_token_ids=None if prompt.from_client_ids else prompt.token_ids,
                tenant=tenant,
                lora_request=lora_request,
            )
            streams.append(stream)
    except ValueError as error:
        abort_all(streams)
        raise from_engine_error(error) from None
    except RecursionError:  # e.g. a structured-output spec nested too deeply to analyse
        abort_all(streams)
        raise bad_request(
            "The structured-output spec is nested too deeply.", code="invalid_structured_output"
        ) from None
    except BaseException:
        abort_all(streams)
        raise
    return streams


def reservation(
    max_model_len: int, params: SamplingParams, prompt_lengths: list[int]
) -> tuple[int, int]:
    """(sequences, tokens) a request may use: n samples of each prompt, each up to its prompt
    plus max_tokens (the rest of the context when max_tokens is not set)."""
    tokens = 0
    for length in prompt_lengths:
        budget = params.max_tokens if params.max_tokens is not None else max_model_len - length
        tokens += length + max(0, budget)
    return params.n * len(prompt_lengths), params.n * tokens


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


def _checked(output: RequestOutput) -> RequestOutput:
    """`output`, or APIError (400) if the engine ended its request early, e.g. a failed grammar."""
    if output.error is not None:
        raise request_failed(output.error, output.failure)
    return output


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they arrive; aborts them all if closed early.

    Raises APIError (400) when the engine ended a request early (`RequestOutput.error`)."""
    try:
        if len(streams) == 1:
            async for output in streams[0]:
                yield 0, _checked(output)
            return
        pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        output = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
                    yield i, _checked(output)
        finally:
            for task in pending:
                task.cancel()
    finally:
        abort_all(streams)


async def first_output_then_rest(
    request: Request, streams: list[RequestStream], poll_s: float
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`merge_streams(streams)` with its first output already awaited.

    A streamed response waits for this before it sends its 200, so that whatever the engine
    refuses before the first token (a grammar that fails to compile in the background) is
    answered as a 4xx JSON error, not as an error event inside a 200. Raises APIError."""
    merged = merge_streams(streams)
    with abort_on_disconnect(request, streams, poll_s):
        try:
            first = await anext(merged)
        except StopAsyncIteration:
            return merged
        except BaseException:
            await merged.aclose()
            raise
    return _prepend(first, merged)


async def _prepend(
    first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


@contextmanager
def abort_on_disconnect(
    request: Request, streams: list[RequestStream], poll_s: float
) -> Iterator[None]:
    """While the body runs, poll the connection and abort the streams if the client leaves."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(poll_s)
        abort_all(streams)

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        watcher.cancel()


@dataclass
class Choice:
    """One choice's output so far, gathered from DELTA outputs."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # its prompt's, with `prompt_logprobs` set

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def full_text(self) -> str:
        return "".join(self.text)


@dataclass
class UsageCounter:
    """Prompt, completion and cached prompt tokens over every prompt of one API request."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = output.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }


async def collect(
    streams: list[RequestStream],
    n: int,
    view: Callable[[RequestOutput], RequestOutput] | None = None,
) -> tuple[list[Choice], UsageCounter]:
    """Run every stream to its end; choices are numbered prompt_index * n + sample index.

    `view`, if given, rewrites each output before it counts (e.g. to drop generated tokens)."""
    choices = [Choice(i) for i in range(len(streams) * n)]
    usage = UsageCounter()
    async for prompt_index, output in merge_streams(streams):
        if view is not None:
            output = view(output)
        usage.add(prompt_index, output)
        if output.prompt_logprobs is not None:
            for choice in choices[prompt_index * n : (prompt_index + 1) * n]:
                choice.prompt_logprobs = output.prompt_logprobs
        for delta in output.outputs:
            choices[prompt_index * n + delta.index].add(delta)
    return choices, usage
