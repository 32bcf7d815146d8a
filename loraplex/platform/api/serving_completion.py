"""POST /v1/completions: one or more prompts (text or token ids), streamed (SSE) or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from loraplex.platform.api.auth import tenant_of
from loraplex.platform.api.generation import (
    SSE_DONE,
    Prompt,
    UsageCounter,
    abort_all,
    abort_on_disconnect,
    collect,
    error_event,
    merge_streams,
    new_id,
    now_s,
    sse,
    submit,
)
from loraplex.platform.api.logprobs import completion_logprobs
from loraplex.platform.api.protocol import CompletionRequest
from loraplex.platform.api.request_body import read_json_model
from loraplex.platform.api.sampling import completion_sampling_params
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.engine.async_engine import RequestStream
from loraplex.platform.models.tokenizer import Tokenizer

router = APIRouter()


def tokenize_prompts(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[Prompt]:
    """Text prompts are encoded; token-id prompts are decoded (for `echo`) and kept as given."""
    return [
        Prompt(p, tokenizer.encode(p)) if isinstance(p, str) else _from_ids(tokenizer, p)
        for p in prompts
    ]


def _from_ids(tokenizer: Tokenizer, ids: list[int]) -> Prompt:
    # NOTE: out-of-range ids decode to nothing here; the engine refuses them with a 400.
    known = [t for t in ids if 0 <= t < tokenizer.vocab_size]
    return Prompt(tokenizer.decode(known), ids, from_client_ids=True)


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    limit = state.settings.max_request_body_bytes
    body = await read_json_model(request, CompletionRequest, limit)
    tenant = tenant_of(request).name
    served = state.models.resolve_model(body.model, tenant)
    params = completion_sampling_params(body)
    prompts = await asyncio.to_thread(tokenize_prompts, state.engine.tokenizer, body.prompts)
    request_id = new_id("cmpl")
    streams = await submit(
        state.engine, prompts, params, request_id, tenant, lora_request=served.lora_request
    )
    if body.stream:
        events = _completion_events(request, state, body, prompts, streams, request_id, served.name)
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(abort_all, streams)
        )
    with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
        choices, usage = await collect(streams, body.n)
    result = []
    for c in choices:
        prefix = prompts[c.index // body.n].text if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(c.logprobs, body.logprobs, len(prefix))
        result.append(
            {
                "index": c.index,
                "text": prefix + c.full_text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": served.name,
            "choices": result,
            "usage": usage.as_dict(),
            "system_fingerprint": None,
        }
    )


async def _completion_events(
    request: Request,
    state: ServerState,
    body: CompletionRequest,
    prompts: list[Prompt],
    streams: list[RequestStream],
    request_id: str,
    model_name: str,
) -> AsyncIterator[str]:
    head: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": now_s(),
        "model": model_name,
        "system_fingerprint": None,
    }
    if body.include_usage:
        head["usage"] = None
    usage = UsageCounter()
    offsets = [0] * (len(prompts) * body.n)  # text length sent so far, per choice
    try:
        with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
            if body.echo:
                for index in range(len(offsets)):
                    text = prompts[index // body.n].text
                    offsets[index] = len(text)
                    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
                    yield sse({**head, "choices": [choice]})
            async for prompt_index, output in merge_streams(streams):
                usage.add(prompt_index, output)
                for delta in output.outputs:
                    if not (delta.text or delta.logprobs or delta.finish_reason):
                        continue
                    index = prompt_index * body.n + delta.index
                    logprobs = None
                    if body.logprobs is not None:
                        entries = delta.logprobs or []
                        logprobs = completion_logprobs(entries, body.logprobs, offsets[index])
                    offsets[index] += len(delta.text)
                    choice = {
                        "index": index,
                        "text": delta.text,
                        "logprobs": logprobs,
                        "finish_reason": delta.finish_reason,
                    }
                    if delta.finish_reason is not None:
                        choice["stop_reason"] = delta.stop_reason
                    yield sse({**head, "choices": [choice]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage.as_dict()})
    except Exception as error:
        yield error_event(error)
    yield SSE_DONE
