"""The engine requests of one API request: submitting its prompts (one engine request each),
merging their output streams, and aborting them all when the client disconnects or the
response ends early."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi import Request

from loraplex.adapters.request import LoRARequest
from loraplex.platform.api.errors import bad_request, from_engine_error, request_failed
from loraplex.platform.api.tenancy.limits import limit_error, reserve
from loraplex.platform.core.errors import TenantLimitExceeded
from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.tenant_caps import TenantCaps
from loraplex.platform.engine.protocol import EngineClient
from loraplex.platform.engine.request_stream import RequestStream


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
    fields: Mapping[str, str] | None = None,
    caps: TenantCaps | None = None,
) -> list[RequestStream]:
    """Add one engine request per prompt, each holding its part of the tenant's `caps` (see
    `tenancy/limits.py`); if any is refused, abort the others and raise 4xx (429 for a tenant
    over its caps; `fields`: the request's names of the engine's fields, see
    `from_engine_error`)."""
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
                reservation=reserve(caps, engine, params, len(prompt.token_ids)),
            )
            streams.append(stream)
    except ValueError as error:
        abort_all(streams)
        raise from_engine_error(error, fields) from None
    except TenantLimitExceeded as error:
        abort_all(streams)
        raise limit_error(error) from None
    except RecursionError:  # e.g. a structured-output spec nested too deeply to analyse
        abort_all(streams)
        raise bad_request(
            "The structured-output spec is nested too deeply.", code="invalid_structured_output"
        ) from None
    except BaseException:
        abort_all(streams)
        raise
    return streams


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


def _checked(output: RequestOutput) -> RequestOutput:
    """`output`, or APIError (400) if the engine ended its request early, e.g. a failed grammar."""
    if output.error is not None:
        raise request_failed(output.error, output.failure)
    return output


async def merge_streams(
    streams: list[RequestStream], first: tuple[int, RequestOutput] | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they arrive (after `first`, an output already
    taken from them); aborts them all if closed early.

    Raises APIError (400) when the engine ended a request early (`RequestOutput.error`)."""
    try:
        if first is not None:
            yield first
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
    if len(streams) == 1:
        # NOTE: one stream (nearly every request): its first output is read here, and the
        # rest of it through one generator, which costs less per token than two.
        with abort_on_disconnect(request, streams, poll_s):
            try:
                first = await anext(streams[0])
            except StopAsyncIteration:
                return merge_streams(streams)
            except BaseException:
                abort_all(streams)
                raise
        return merge_streams(streams, (0, _checked_or_abort(first, streams)))
    merged = merge_streams(streams)
    with abort_on_disconnect(request, streams, poll_s):
        try:
            first_item = await anext(merged)
        except StopAsyncIteration:
            return merged
        except BaseException:
            await merged.aclose()
            raise
    return _prepend(first_item, merged)


def _checked_or_abort(output: RequestOutput, streams: list[RequestStream]) -> RequestOutput:
    try:
        return _checked(output)
    except BaseException:
        abort_all(streams)
        raise


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
