"""POST /v1/chat/completions: the chat template, then the engine, streamed (SSE) or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.openai.choices import UsageCounter, collect
from loraplex.platform.api.openai.ids import new_id, now_s
from loraplex.platform.api.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from loraplex.platform.api.openai.protocol import ChatCompletionRequest
from loraplex.platform.api.openai.request_streams import (
    Prompt,
    abort_all,
    abort_on_disconnect,
    first_output_then_rest,
    submit,
)
from loraplex.platform.api.openai.sampling import chat_sampling_params
from loraplex.platform.api.openai.sse import SSE_DONE, ChunkFrames, error_event, sse
from loraplex.platform.api.openai.tools.tool_auto import submit_auto
from loraplex.platform.api.openai.tools.tool_call_stream import ToolCallStream
from loraplex.platform.api.openai.tools.tool_calls import (
    ToolRequest,
    new_call_id,
    parse_output,
    template_messages,
    template_supports_tools,
    tool_calls_json,
    tool_request_for,
)
from loraplex.platform.api.openai.tools.tool_parsers import (
    ToolParser,
    get_tool_parser,
    parser_for_template,
)
from loraplex.platform.api.request_body import json_body, read_json_model
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenancy.auth import admit, tenant_of
from loraplex.platform.api.tenancy.limits import reservation
from loraplex.platform.api.tenancy.model_resolver import ServedModel
from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.tenant_caps import TenantCaps
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.tokenizer.tokenizer import Tokenizer

router = APIRouter()
# The engine's field names (errors' `param`) as a chat request names them.
CHAT_FIELDS = {"prompt": "messages"}


def tool_parser(state: ServerState, tokenizer: Tokenizer | None = None) -> ToolParser:
    """The server's tool-call parser: `--tool-call-parser`, else the format of the chat
    template of `tokenizer` (the request's; None: the base model's)."""
    name = state.settings.tool_call_parser
    template = (tokenizer or state.engine.tokenizer).chat_template
    return get_tool_parser(name) if name else parser_for_template(template)


async def render_chat_prompt(
    state: ServerState,
    tokenizer: Tokenizer,
    body: ChatCompletionRequest,
    tenant: str,
    tools: ToolRequest | None = None,
    parser: ToolParser | None = None,
) -> Prompt:
    """The conversation (with its tools, calls and tool results) through the model's chat
    template, as text and token ids. The template renders in one of the server's render
    processes under its time limit (`ChatTemplateRenderer`, 400 when it fails or is too slow),
    its text at most what the context could hold."""
    if tokenizer.chat_template is None:
        raise bad_request(
            "this model has no chat template; use completions instead", param="messages"
        )
    native = template_supports_tools(tokenizer.chat_template)
    messages, template_tools = template_messages(
        body.messages, tools, parser or parser_for_template(None), native
    )
    try:
        context = tokenizer.chat_template_context(
            messages,
            body.add_generation_prompt,
            template_tools,
            **(body.chat_template_kwargs or {}),
        )
    except TypeError as error:
        raise bad_request(str(error), param="chat_template_kwargs") from None
    max_chars = (
        state.limits_for(tokenizer).max_prompt_chars or state.settings.max_request_body_bytes
    )
    text = await state.chat_templates.render(tokenizer.chat_template, context, max_chars, tenant)
    return Prompt(text, await asyncio.to_thread(tokenizer.encode, text, False))


def with_tool_grammar(params: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
    """`params` constrained to `tools`' calls (`required` / named); 400 if another output
    constraint (`response_format`, ...) is set too."""
    grammar = tools.structured_outputs() if tools is not None else None
    if grammar is None:
        return params
    if params.structured_outputs is not None:
        raise bad_request(
            "tool_choice 'required' or a named function cannot be combined with another output "
            "constraint (response_format, structured_outputs, guided_*)",
            param="tool_choice",
        )
    return replace(params, structured_outputs=grammar)


def assistant_message(
    text: str, tools: ToolRequest | None, parser: ToolParser, finish_reason: str | None = None
) -> tuple[dict[str, Any], bool]:
    """OpenAI's assistant `message` of one choice's text, and whether it holds tool calls (a
    forced call cut by the token limit is one, with the arguments written so far)."""
    if tools is None or tools.mode == "none":
        return {"role": "assistant", "content": text}, False
    parsed = parse_output(text, tools, parser, truncated=finish_reason == "length")
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if not parsed.tool_calls:
        message["content"] = parsed.content
        return message, False
    ids = [new_call_id() for _ in parsed.tool_calls]
    message["tool_calls"] = tool_calls_json(parsed.tool_calls, ids)
    return message, True


async def submit_chat(
    state: ServerState,
    prompt: Prompt,
    params: SamplingParams,
    request_id: str,
    tenant: str,
    served: ServedModel,
    tools: ToolRequest | None,
    parser: ToolParser,
    fields: Mapping[str, str] = CHAT_FIELDS,
    caps: TenantCaps | None = None,
) -> list[RequestStream]:
    """The engine requests of one chat prompt: one request, or under `tool_choice: "auto"` a
    chain per choice that enforces a call once the model opens one (`tool_auto`); each holds
    its part of the tenant's `caps`. `fields`: the request's names of the engine's fields, for
    errors (see `from_engine_error`)."""
    if tools is not None and tools.mode == "auto":
        streams = await submit_auto(
            state.engine, prompt, params, request_id, tools, parser, tenant, served.lora_request,
            fields, caps,
        )  # fmt: skip
        return streams  # type: ignore[return-value]
    return await submit(
        state.engine, [prompt], params, request_id, tenant, served.lora_request, fields, caps
    )


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A choice that ended by itself with calls finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if has_calls and reason == "stop" else reason


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready to submit: its model, tools and parser, sampling parameters, the
    rendered prompt and the tenant's caps it was admitted under."""

    served: ServedModel
    tools: ToolRequest | None
    parser: ToolParser
    params: SamplingParams
    prompt: Prompt
    caps: TenantCaps | None


async def prepare_chat(
    request: Request, state: ServerState, body: ChatCompletionRequest, tenant: str
) -> PreparedChat:
    """Resolve `body`'s model, build its sampling parameters (tool grammar included), render its
    prompt and admit it under the tenant's caps: what chat completions and the Responses API
    do before submitting."""
    served = state.models.resolve_model(body.model, tenant)
    tools = tool_request_for(body)
    tokenizer = await state.tokenizer_of(served)
    parser = tool_parser(state, tokenizer)
    defaults = state.engine.generation_defaults
    params = chat_sampling_params(body, state.limits_for(tokenizer), defaults)
    params = with_tool_grammar(params, tools)
    prompt = await render_chat_prompt(state, tokenizer, body, tenant, tools, parser)
    caps = admit(
        request,
        *reservation(state.engine.max_model_len, params, [len(prompt.token_ids)], defaults),
    )
    return PreparedChat(served, tools, parser, params, prompt, caps)


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    limit = state.settings.max_request_body_bytes
    body = await read_json_model(request, ChatCompletionRequest, limit)
    tenant = tenant_of(request).name
    chat = await prepare_chat(request, state, body, tenant)
    served, tools, parser, params = chat.served, chat.tools, chat.parser, chat.params
    request_id = new_id("chatcmpl")
    streams = await submit_chat(
        state, chat.prompt, params, request_id, tenant, served, tools, parser, caps=chat.caps
    )
    if body.stream:
        poll_s = state.settings.disconnect_poll_s
        outputs = await first_output_then_rest(request, streams, poll_s)
        events = _chat_events(
            request, state, body, streams, outputs, request_id, served.name, tools, parser
        )
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(abort_all, streams)
        )
    with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
        choices, usage = await collect(streams, body.n)
    top_k = body.top_logprobs or 0
    answers = [assistant_message(c.full_text, tools, parser, c.finish_reason) for c in choices]
    response: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": now_s(),
        "model": served.name,
        "choices": [
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs, top_k) if body.logprobs else None,
                "finish_reason": finish_reason(c.finish_reason, has_calls),
                "stop_reason": c.stop_reason,
            }
            for c, (message, has_calls) in zip(choices, answers, strict=True)
        ],
        "usage": usage.as_dict(),
        "system_fingerprint": None,
    }
    if body.prompt_logprobs is not None:  # vLLM's extra: on the response, not on each choice
        scores = choices[0].prompt_logprobs or []
        response["prompt_logprobs"] = await asyncio.to_thread(
            vllm_prompt_logprobs, chat.prompt.token_ids, scores, body.prompt_logprobs
        )
    return JSONResponse(response)


def _delta_choice(
    body: ChatCompletionRequest,
    index: int,
    delta: dict[str, Any],
    logprobs: Any,
    finish: str | None,
    stop: Any,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
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
    tools: ToolRequest | None,
    parser: ToolParser,
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
    frames = ChunkFrames(head)
    usage = UsageCounter()
    mode = "none" if tools is None else tools.mode
    named = None if tools is None else tools.named
    names = () if tools is None else tools.names
    calls = [ToolCallStream(mode, parser, named, new_call_id, names) for _ in range(body.n)]
    # NOTE: without tools and logprobs a running choice's delta is its text as content
    plain = mode == "none" and not body.logprobs
    try:
        with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
            for i in range(body.n):
                role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                yield frames.choice({**role, "logprobs": None, "finish_reason": None})
            async for _, output in outputs:
                usage.add(0, output)
                for delta in output.outputs:
                    if not (delta.text or delta.logprobs or delta.finish_reason):
                        continue
                    if plain and delta.finish_reason is None and delta.text:
                        yield frames.content(delta.index, delta.text)  # nearly every chunk
                        continue
                    stream = calls[delta.index]
                    pieces = stream.feed(delta.text)
                    if delta.finish_reason is not None:
                        pieces += stream.finish(delta.finish_reason)
                    # NOTE: logprobs ride on the first piece of this delta; a delta whose text
                    # is held back (a call may be starting) still carries them.
                    if not pieces and (delta.logprobs or delta.finish_reason):
                        pieces = [{}]
                    for k, piece in enumerate(pieces):
                        last = k == len(pieces) - 1
                        finish = delta.finish_reason if last else None
                        choice = _delta_choice(
                            body,
                            delta.index,
                            piece,
                            (delta.logprobs or []) if k == 0 else [],
                            finish_reason(finish, stream.has_calls),
                            delta.stop_reason,
                        )
                        yield frames.choice(choice)
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage.as_dict()})
    except Exception as error:
        yield error_event(error)
    yield SSE_DONE
