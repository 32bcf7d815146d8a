"""POST /v1/completions: one or more prompts (text or token ids), streamed (SSE) or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from loraplex.platform.api.openai.choices import Choice, UsageCounter, collect
from loraplex.platform.api.openai.ids import new_id, now_s
from loraplex.platform.api.openai.logprobs import (
    completion_logprobs,
    echo_logprobs,
    join_completion_logprobs,
    vllm_prompt_logprobs,
)
from loraplex.platform.api.openai.protocol import CompletionRequest
from loraplex.platform.api.openai.request_streams import (
    Prompt,
    abort_all,
    abort_on_disconnect,
    first_output_then_rest,
    submit,
)
from loraplex.platform.api.openai.sampling import completion_sampling_params
from loraplex.platform.api.openai.sse import SSE_DONE, ChunkFrames, error_event, sse
from loraplex.platform.api.request_body import json_body, read_json_model
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenancy.auth import admit, tenant_of
from loraplex.platform.api.tenancy.limits import reservation
from loraplex.platform.core.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.tokenizer.tokenizer import Tokenizer

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


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    limit = state.settings.max_request_body_bytes
    body = await read_json_model(request, CompletionRequest, limit)
    tenant = tenant_of(request).name
    served = state.models.resolve_model(body.model, tenant)
    tokenizer = await state.tokenizer_of(served)
    defaults = state.engine.generation_defaults
    params = completion_sampling_params(body, state.limits_for(tokenizer), defaults)
    prompts = await asyncio.to_thread(tokenize_prompts, tokenizer, body.prompts)
    lengths = [len(p.token_ids) for p in prompts]
    caps = admit(request, *reservation(state.engine.max_model_len, params, lengths, defaults))
    request_id = new_id("cmpl")
    streams = await submit(
        state.engine, prompts, params, request_id, tenant, served.lora_request, caps=caps
    )
    if body.stream:
        poll_s = state.settings.disconnect_poll_s
        outputs = await first_output_then_rest(request, streams, poll_s)
        events = _completion_events(request, state, tokenizer, body, prompts, streams, outputs,
                                    request_id, served.name)  # fmt: skip
        return StreamingResponse(
            events, media_type="text/event-stream", background=BackgroundTask(abort_all, streams)
        )
    view = without_generated if body.echo_only else None
    with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
        choices, usage = await collect(streams, body.n, view)
    if params.prompt_logprobs is None:
        result = _choices(body, tokenizer, prompts, choices)
    else:  # NOTE: a long prompt's scores take a while to shape: keep the event loop free.
        result = await asyncio.to_thread(_choices, body, tokenizer, prompts, choices)
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


def without_generated(output: RequestOutput) -> RequestOutput:
    """`output` as an `echo_only` request (max_tokens 0) shows it: the one token the engine had
    to generate is dropped from text, logprobs and usage, and a sample that ended reports
    "length", having reached max_tokens 0."""
    return replace(output, outputs=[_dropped(sample) for sample in output.outputs])


def _dropped(sample: CompletionOutput) -> CompletionOutput:
    finish = sample.finish_reason
    if finish is not None and finish != "abort":
        finish = "length"
    logprobs = None if sample.logprobs is None else []
    return CompletionOutput(sample.index, "", [], logprobs, finish_reason=finish)


@dataclass(frozen=True)
class EchoedPrompt:
    """What a choice shows of its prompt: the echoed text ("" without `echo`), the text's legacy
    logprobs (`echo` with `logprobs`) and vLLM's `prompt_logprobs` (when asked for)."""

    text: str
    logprobs: dict[str, Any] | None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None


def echoed_prompt(
    body: CompletionRequest, tokenizer: Tokenizer, prompt: Prompt, scores: PromptLogprobs | None
) -> EchoedPrompt:
    """The prompt's part of a choice, from the engine's prompt logprobs `scores`."""
    text = prompt.text if body.echo else ""
    logprobs = None
    if body.echo and body.logprobs is not None:
        first = tokenizer.decode(prompt.token_ids[:1], skip_special_tokens=False)
        logprobs = echo_logprobs(prompt.token_ids, scores or [], first, body.logprobs)
    prompt_logprobs = None
    if body.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(prompt.token_ids, scores or [], body.prompt_logprobs)
    return EchoedPrompt(text, logprobs, prompt_logprobs)


def _choices(
    body: CompletionRequest, tokenizer: Tokenizer, prompts: list[Prompt], choices: list[Choice]
) -> list[dict[str, Any]]:
    result = []
    for c in choices:
        echoed = echoed_prompt(body, tokenizer, prompts[c.index // body.n], c.prompt_logprobs)
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(c.logprobs, body.logprobs, len(echoed.text))
            if echoed.logprobs is not None:
                logprobs = join_completion_logprobs(echoed.logprobs, logprobs)
        choice = {
            "index": c.index,
            "text": echoed.text + c.full_text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if echoed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = echoed.prompt_logprobs
        result.append(choice)
    return result


async def _completion_events(
    request: Request,
    state: ServerState,
    tokenizer: Tokenizer,
    body: CompletionRequest,
    prompts: list[Prompt],
    streams: list[RequestStream],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
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
    frames = ChunkFrames(head)
    usage = UsageCounter()
    offsets = [0] * (len(prompts) * body.n)  # text length sent so far, per choice
    started: set[int] = set()  # prompts whose first output has arrived
    n, want_logprobs = body.n, body.logprobs is not None
    try:
        with abort_on_disconnect(request, streams, state.settings.disconnect_poll_s):
            async for prompt_index, output in outputs:
                if body.echo_only:
                    output = without_generated(output)
                usage.add(prompt_index, output)
                if prompt_index not in started:
                    started.add(prompt_index)
                    # NOTE: the echoed prompt waits for the first output, which brings its
                    # prompt logprobs; each choice's first chunk carries it.
                    for index, choice in _first_choices(
                        body, tokenizer, prompts, prompt_index, output
                    ):
                        offsets[index] = len(choice["text"])
                        yield frames.choice(choice)
                for delta in output.outputs:
                    text, finish_reason = delta.text, delta.finish_reason
                    if not (text or delta.logprobs or finish_reason):
                        continue
                    index = prompt_index * n + delta.index
                    if not want_logprobs and finish_reason is None:
                        yield frames.text(index, text)  # nearly every chunk of a stream
                        continue
                    logprobs = None
                    if want_logprobs:
                        entries = delta.logprobs or []
                        logprobs = completion_logprobs(entries, body.logprobs, offsets[index])
                    offsets[index] += len(text)
                    choice = {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                    }
                    if finish_reason is not None:
                        choice["stop_reason"] = delta.stop_reason
                    yield frames.choice(choice)
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage.as_dict()})
    except Exception as error:
        yield error_event(error)
    yield SSE_DONE


def _first_choices(
    body: CompletionRequest,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    prompt_index: int,
    output: RequestOutput,
) -> list[tuple[int, dict[str, Any]]]:
    """(choice index, choice) of the first chunk of each of a prompt's n choices, when the
    request echoes the prompt or asks for its logprobs; none otherwise."""
    if not body.echo and body.prompt_logprobs is None:
        return []
    prompt = prompts[prompt_index]
    echoed = echoed_prompt(body, tokenizer, prompt, output.prompt_logprobs)
    logprobs = echoed.logprobs
    if logprobs is None and body.logprobs is not None:
        logprobs = completion_logprobs([], body.logprobs, 0)
    choice: dict[str, Any] = {"text": echoed.text, "logprobs": logprobs, "finish_reason": None}
    if echoed.prompt_logprobs is not None:
        choice["prompt_logprobs"] = echoed.prompt_logprobs
    first = prompt_index * body.n
    return [(i, {"index": i, **choice}) for i in range(first, first + body.n)]
