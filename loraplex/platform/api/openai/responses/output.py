"""The Responses API's output: the response object, its output items, and the server-sent
events of a streamed response (`response.created` ... `response.completed`), built from the
same chat deltas a streamed chat completion sends (`ToolCallStream`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from loraplex.platform.api.openai.choices import UsageCounter


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any], finish_reason: str | None = None) -> list[dict]:
    """Output items of a chat assistant `message` (text first, then each call); the last is
    "incomplete" when the token limit cut it (`finish_reason` "length")."""
    items = [message_item(message["content"])] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(call_item(call["id"], function["name"], function["arguments"]))
    if items and finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def usage_json(usage: UsageCounter) -> dict[str, Any]:
    chat = usage.as_dict()
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def response_json(
    response_id: str,
    created_at: int,
    model: str,
    request: dict[str, Any],
    output: list[dict[str, Any]],
    status: str,
    finish_reason: str | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response object; `request` holds the echoed request fields (instructions, tools,
    ...); a response cut by max_output_tokens is "incomplete", as OpenAI's are."""
    if status == "completed" and finish_reason == "length":
        status = "incomplete"
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "model": model,
        "output": output,
        "usage": usage,
        **request,
    }


class ResponseEventStream:
    """Turns chat deltas (`{"content"}` / `{"tool_calls"}`) into Responses events, in order:
    an output item opens on its first delta, text and argument deltas follow, and every open
    item closes (`*.done`) before `response.completed`."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base  # the response object in progress (output filled here)
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self._text_item: int | None = None  # output index of the open message item
        self._calls: dict[int, int] = {}  # tool-call index -> output index

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        opening = {**self.base, "status": "in_progress", "output": [], "usage": None}
        return [
            self.event("response.created", response=opening),
            self.event("response.in_progress", response=opening),
        ]

    def delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if self._text_item is None:
            item = message_item("", status="in_progress")
            item["content"] = []
            self._text_item = len(self.items)
            self.items.append(item)
            events.append(self.event("response.output_item.added",
                                     output_index=self._text_item, item=item))  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=self._text_item, content_index=0,
                                     part=part))  # fmt: skip
        item = self.items[self._text_item]
        item["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=item["id"],
                                 output_index=self._text_item, content_index=0, delta=text,
                                 logprobs=[]))  # fmt: skip
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        function = call.get("function", {})
        if call.get("id") is not None:
            item = call_item(call["id"], function["name"], "", status="in_progress")
            self._calls[call["index"]] = len(self.items)
            self.items.append(item)
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.items) - 1, item=item))  # fmt: skip
        fragment = function.get("arguments") or ""
        if fragment:
            index = self._calls[call["index"]]
            item = self.items[index]
            item["arguments"] += fragment
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=index,
                                     delta=fragment))  # fmt: skip
        return events

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> tuple[list[str], dict]:
        """The closing events and the final response object."""
        events = []
        for index, item in enumerate(self.items):
            cut = finish_reason == "length" and index == len(self.items) - 1
            item["status"] = "incomplete" if cut else "completed"
            if item["type"] == "message":
                part = item["content"][0]
                events.append(self.event("response.output_text.done", item_id=item["id"],
                                         output_index=index, content_index=0,
                                         text=part["text"], logprobs=[]))  # fmt: skip
                events.append(self.event("response.content_part.done", item_id=item["id"],
                                         output_index=index, content_index=0,
                                         part=part))  # fmt: skip
            else:
                events.append(self.event("response.function_call_arguments.done",
                                         item_id=item["id"], output_index=index,
                                         arguments=item["arguments"]))  # fmt: skip
            events.append(self.event("response.output_item.done", output_index=index,
                                     item=item))  # fmt: skip
        final = {**self.base, "output": self.items, "usage": usage}
        final = response_json(
            final["id"], final["created_at"], final["model"], _echo(final), self.items,
            "completed", finish_reason, usage,
        )  # fmt: skip
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        events.append(self.event(kind, response=final))
        return events, final


_OWN = {"id", "object", "created_at", "status", "error", "incomplete_details", "model", "output",
        "usage"}  # fmt: skip


def _echo(response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in response.items() if k not in _OWN}
