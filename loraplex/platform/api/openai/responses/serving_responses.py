"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat
path.

A request becomes the chat completion that answers it (`input`): the stored
conversation of `previous_response_id`, then `instructions` and `input`. The answer is written
as Responses output items (`output`), streamed with the Responses event types when
`stream` is set. Responses are stored per tenant (`ResponseStore`) unless `store` is false.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.openai.choices import UsageCounter, collect
from loraplex.platform.api.openai.ids import new_id, now_s
from loraplex.platform.api.openai.protocol import ResponsesRequest
from loraplex.platform.api.openai.request_streams import (
    abort_all,
    abort_on_disconnect,
    first_output_then_rest,
)
from loraplex.platform.api.openai.responses.input import (
    chat_request,
    input_messages,
    refuse_unsupported,
)
from loraplex.platform.api.openai.responses.output import (
    ResponseEventStream,
    output_items,
    response_json,
    usage_json,
)
from loraplex.platform.api.openai.responses.store import ResponseStore, StoredResponse
from loraplex.platform.api.openai.serving_chat import (
    assistant_message,
    prepare_chat,
    submit_chat,
)
from loraplex.platform.api.openai.sse import error_event
from loraplex.platform.api.openai.tools.tool_call_stream import ToolCallStream
from loraplex.platform.api.openai.tools.tool_calls import new_call_id
from loraplex.platform.api.request_body import json_body, read_json_model
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenancy.auth import tenant_of
from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.engine.request_stream import RequestStream

router = APIRouter()
BODY_MODELS = (ResponsesRequest,)
# The engine's field names (errors' `param`) as a Responses request names them.
RESPONSES_FIELDS = {"prompt": "input", "max_tokens": "max_output_tokens"}


def response_store(request: Request) -> ResponseStore:
    """The app's ResponseStore (set by `build_app`)."""
    return request.app.state.responses


def _not_found(response_id: str, param: str = "previous_response_id") -> APIError:
    return APIError(
        404,
        f"No response with id '{response_id}' found.",
        type="not_found_error",
        param=param,
        code="response_not_found",
    )


def _echoed(body: ResponsesRequest, params: SamplingParams) -> dict[str, Any]:
    """The request fields a response object repeats (sampling as it ran: the request's
    values, else the server's defaults)."""
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice or "auto",
        "parallel_tool_calls": True
        if body.parallel_tool_calls is None
        else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "text": body.text or {"format": {"type": "text"}},
        "metadata": body.metadata or {},
        "truncation": "disabled",
        "user": body.user,
    }


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
async def create_response(request: Request) -> Response:
    state = server_state(request)
    body = await read_json_model(request, ResponsesRequest, state.settings.max_request_body_bytes)
    refuse_unsupported(body)
    tenant = tenant_of(request).name
    store = response_store(request)
    history: tuple[dict[str, Any], ...] = ()
    if body.previous_response_id is not None:
        previous = await asyncio.to_thread(store.get, tenant, body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id)
        history = previous.messages
    conversation = [*history, *input_messages(body)]
    chat = chat_request(body, conversation)
    prepared = await prepare_chat(request, state, chat, tenant)
    served, tools, parser, params = (
        prepared.served,
        prepared.tools,
        prepared.parser,
        prepared.params,
    )
    response_id = new_id("resp").replace("-", "_")
    created = now_s()

    def save(final: dict[str, Any], message: dict[str, Any]) -> None:
        if body.store:
            store.put(tenant, response_id, StoredResponse(final, (*conversation, message)))

    streams = await submit_chat(
        state, prepared.prompt, params, response_id, tenant, served, tools, parser,
        RESPONSES_FIELDS, prepared.caps,
    )  # fmt: skip
    if body.stream:
        outputs = await first_output_then_rest(request, streams, state.settings.disconnect_poll_s)
        base = response_json(response_id, created, served.name, _echoed(body, params), [], "in_progress",
                             None, None)  # fmt: skip
        mode = "none" if tools is None else tools.mode
        named, names = (None, ()) if tools is None else (tools.named, tools.names)
        calls = ToolCallStream(mode, parser, named, new_call_id, names)
        events = _events(request, state, streams, outputs, ResponseEventStream(base), calls, save)
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(abort_all, streams)
        )
    with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
        (choice,), usage = await collect(streams, 1)
    message, _ = assistant_message(choice.full_text, tools, parser, choice.finish_reason)
    final = response_json(response_id, created, served.name, _echoed(body, params),
                          output_items(message, choice.finish_reason), "completed",
                          choice.finish_reason, usage_json(usage))  # fmt: skip
    await asyncio.to_thread(save, final, message)
    return JSONResponse(final)


async def _events(
    request: Request,
    state: ServerState,
    streams: list[RequestStream],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    events: ResponseEventStream,
    calls: ToolCallStream,
    save: Callable[[dict[str, Any], dict[str, Any]], None],
) -> AsyncIterator[str]:
    """The Responses events of one streamed response; stores it once it completes."""
    usage = UsageCounter()
    finish = None
    try:
        with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
            for event in events.start():
                yield event
            async for _, output in outputs:
                usage.add(0, output)
                for delta in output.outputs:
                    pieces = calls.feed(delta.text)
                    if delta.finish_reason is not None:
                        finish = delta.finish_reason
                        pieces += calls.finish(delta.finish_reason)
                    for piece in pieces:
                        for event in events.delta(piece):
                            yield event
            closing, final = events.finish(finish, usage_json(usage))
            await asyncio.to_thread(save, final, _message_of(final["output"]))
            for event in closing:
                yield event
    except Exception as error:
        yield error_event(error)


def _message_of(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat assistant message of a response's output items (for the stored conversation)."""
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in items
        if item["type"] == "function_call"
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> JSONResponse:
    stored = await asyncio.to_thread(
        response_store(request).get, tenant_of(request).name, response_id
    )
    if stored is None:
        raise _not_found(response_id, "response_id")
    return JSONResponse(stored.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    """OpenAI's delete: the caller's stored response is gone (another tenant's is a 404)."""
    store = response_store(request)
    if not await asyncio.to_thread(store.delete, tenant_of(request).name, response_id):
        raise _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
