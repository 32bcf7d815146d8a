"""From a Responses-API request to the chat request that serves it: input items to chat
messages, function tools and `tool_choice` to chat's, `text.format` to `response_format`.

Anything the Responses API offers that we do not serve (built-in tools, images and files,
background runs, reasoning, logprobs, `include`) is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from loraplex.platform.api.errors import bad_request, from_validation_error
from loraplex.platform.api.openai.protocol import ChatCompletionRequest, ResponsesRequest

_TEXT_PARTS = ("input_text", "output_text", "text")


def refuse_unsupported(body: ResponsesRequest) -> None:
    """400 for fields whose meaning we would otherwise silently change."""
    if body.background:
        raise bad_request("background responses are not supported", param="background")
    if body.include:
        raise bad_request(f"include {body.include[0]!r} is not supported", param="include")
    if body.reasoning is not None:
        raise bad_request("reasoning options are not supported by this model", param="reasoning")
    if body.top_logprobs is not None:
        raise bad_request("top_logprobs is not supported on responses", param="top_logprobs")
    for name in ("conversation", "prompt", "max_tool_calls"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not supported", param=name)


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (without `instructions`)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message" or ("role" in item and "type" not in item):
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}
            )
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", f"input.{i}.type")
    return messages


def _text(content: Any, index: int) -> Any:
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"input[{index}].content[{j}]: {kind} content parts are not supported by this "
                "server (text-only model)",
                param=f"input.{index}.content.{j}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(
                f"a {kind} content part needs `text`, a string",
                param=f"input.{index}.content.{j}.text",
            )
        texts.append(text)
    return "".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", ...}`) in chat's shape."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools of type {tool.get('type')!r} are not supported (function tools only)",
                param=f"tools.{i}.type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise bad_request("text.format must be an object", param="text.format")
    if spec.get("type") == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "text.format of type 'json_schema' needs schema, a JSON object",
                param="text.format.schema",
            )
        schema = {"name": spec.get("name", "response"), "schema": spec.get("schema")}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": spec.get("type")}


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion that answers `body` over the conversation `messages`."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": chat_tools(body.tools),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text),
        "user": body.user,
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as error:
        raise from_validation_error(error) from None
