"""POST /v1/chat/completions: the chat template, then the engine, streamed (SSE) or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from loraplex.platform.api.auth import admit, tenant_of
from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.generation import (
    SSE_DONE,
    Prompt,
    UsageCounter,
    abort_all,
    abort_on_disconnect,
    collect,
    error_event,
    first_output_then_rest,
    new_id,
    now_s,
    reservation,
    sse,
    submit,
)
from loraplex.platform.api.logprobs import chat_logprobs, vllm_prompt_logprobs
from loraplex.platform.api.protocol import ChatCompletionRequest
from loraplex.platform.api.request_body import json_body, read_json_model
from loraplex.platform.api.sampling import chat_sampling_params
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.engine.async_engine import RequestStream
from loraplex.platform.models.tokenizer import Tokenizer

router = APIRouter()


def render_chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest) -> Prompt:
    """The conversation through the model's chat template, as text and token ids."""
    messages = [m.as_template_dict() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
    except (ValueError, TypeError, jinja2.TemplateError) as error:
        raise bad_request(f"The chat template failed: {error}", param="messages") from None
    return Prompt(text, tokenizer.encode(text, add_special_tokens=False))


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    limit = state.settings.max_request_body_bytes
    body = await read_json_model(request, ChatCompletionRequest, limit)
    tenant = tenant_of(request).name
    served = state.models.resolve_model(body.model, tenant)
    params = chat_sampling_params(body, state.request_limits)
    prompt = await asyncio.to_thread(render_chat_prompt, state.engine.tokenizer, body)
    admit(request, *reservation(state.engine.max_model_len, params, [len(prompt.token_ids)]))
    request_id = new_id("chatcmpl")
    streams = await submit(
        state.engine, [prompt], params, request_id, tenant, lora_request=served.lora_request
    )
    if body.stream:
        poll_s = state.settings.disconnect_poll_s
        outputs = await first_output_then_rest(request, streams, poll_s)
        events = _chat_events(request, state, body, streams, outputs, request_id, served.name)
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(abort_all, streams)
        )
    with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
        choices, usage = await collect(streams, body.n)
    top_k = body.top_logprobs or 0
    response: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": now_s(),
        "model": served.name,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.full_text},
                "logprobs": chat_logprobs(c.logprobs, top_k) if body.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in choices
        ],
        "usage": usage.as_dict(),
        "system_fingerprint": None,
    }
    if body.prompt_logprobs is not None:  # vLLM's extra: on the response, not on each choice
        scores = choices[0].prompt_logprobs or []
        response["prompt_logprobs"] = await asyncio.to_thread(
            vllm_prompt_logprobs, prompt.token_ids, scores, body.prompt_logprobs
        )
    return JSONResponse(response)


def _delta_choice(
    body: ChatCompletionRequest, index: int, text: str, logprobs: Any, finish: str | None, stop: Any
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": {"content": text} if text else {},
        "logprobs": chat_logprobs(logprobs, body.top_logprobs or 0) if body.logprobs else None,
        "finish_reason": finish,
    }
    if finish is not None:
        choice["stop_reason"] = stop
    return choice


async def _chat_events(
    request: Request,
    state: ServerState,
    body: ChatCompletionRequest,
    streams: list[RequestStream],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    request_id: str,
    model_name: str,
) -> AsyncIterator[str]:
    head = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": now_s(),
        "model": model_name,
        "system_fingerprint": None,
    }
    if body.include_usage:
        head["usage"] = None
    usage = UsageCounter()
    try:
        with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
            for i in range(body.n):
                role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                yield sse({**head, "choices": [{**role, "logprobs": None, "finish_reason": None}]})
            async for _, output in outputs:
                usage.add(0, output)
                for delta in output.outputs:
                    if not (delta.text or delta.logprobs or delta.finish_reason):
                        continue
                    choice = _delta_choice(
                        body,
                        delta.index,
                        delta.text,
                        delta.logprobs or [],
                        delta.finish_reason,
                        delta.stop_reason,
                    )
                    yield sse({**head, "choices": [choice]})
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage.as_dict()})
    except Exception as error:
        yield error_event(error)
    yield SSE_DONE
