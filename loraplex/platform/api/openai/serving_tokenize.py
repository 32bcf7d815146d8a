"""POST /tokenize and POST /detokenize in vLLM's shape, for the tenant's model names.

/tokenize takes a `prompt` (text) or chat `messages` (rendered through the chat template with
their tools, as a chat completion would be) and answers `{"count", "max_model_len", "tokens",
"token_strs"}`; /detokenize takes `tokens` and answers `{"prompt"}`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from loraplex.platform.api.openai.sampling import (
    check_prompt_size,
    check_text_content,
    check_token_ids,
)
from loraplex.platform.api.openai.serving_chat import render_chat_prompt, tool_parser
from loraplex.platform.api.openai.tools.tool_calls import tool_request_for
from loraplex.platform.api.request_body import json_body, read_json_model
from loraplex.platform.api.state import server_state
from loraplex.platform.api.tenancy.auth import tenant_of
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer, Tokenizer

router = APIRouter()
BODY_MODELS = (TokenizeRequest, DetokenizeRequest)


@router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    body = await read_json_model(request, TokenizeRequest, state.settings.max_request_body_bytes)
    served = state.models.resolve_model(body.model, tenant_of(request).name)
    tokenizer = await state.tokenizer_of(served)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must not be empty", param="messages")
        check_text_content(body.messages)
        chat = ChatCompletionRequest(
            messages=body.messages,
            tools=body.tools,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        tools = tool_request_for(chat)
        prompt = await render_chat_prompt(
            state, tokenizer, chat, tenant_of(request).name, tools, tool_parser(state, tokenizer)
        )
        ids = prompt.token_ids
        if body.add_special_tokens:  # the template writes its own; add them only if asked
            ids = tokenizer.encode(prompt.text, add_special_tokens=True)
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        check_prompt_size(body.prompt or "", state.limits_for(tokenizer), "prompt")
        try:
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt or "", add)
        except ValueError as error:  # a model served without a tokenizer
            raise bad_request(str(error), param="prompt") from None
    response: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.engine.max_model_len,
        "tokens": ids,
        "token_strs": _token_strs(tokenizer, ids) if body.return_token_strs else None,
    }
    return JSONResponse(response)


@router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    state = server_state(request)
    limit = state.settings.max_request_body_bytes
    body = await read_json_model(request, DetokenizeRequest, limit)
    served = state.models.resolve_model(body.model, tenant_of(request).name)
    tokenizer = await state.tokenizer_of(served)
    check_token_ids(body.tokens, state.limits_for(tokenizer), "tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})


def _token_strs(tokenizer: Tokenizer | TokenIdsOnlyTokenizer, ids: list[int]) -> list[str | None]:
    """Each id's vocabulary entry (None where the model has no tokenizer)."""
    lookup = getattr(tokenizer, "id_to_token", None)
    return [lookup(i) if lookup is not None else None for i in ids]
