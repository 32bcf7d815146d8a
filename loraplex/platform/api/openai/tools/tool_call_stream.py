"""Streaming tool calls as OpenAI streams them: per call, a first delta with its id and name,
then fragments of its arguments; the fragments of a call join to the non-streamed arguments.

`ToolCallStream` follows one choice's generated text; `scan_required` reads the calls of a
`required` output (a JSON array of `{"name", "arguments"}`) from a text that may be cut
anywhere, so each call's arguments stream as the model writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loraplex.platform.api.openai.tools.tool_parsers import ParsedToolCall, ToolParser

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class CallScan:
    """One call of a partial `required` output: its name once whole (else the part of it
    written so far), and where its arguments start and (once whole) end in the text."""

    name: str | None
    arguments_start: int | None
    arguments_end: int | None
    partial_name: str | None = None  # the name's first characters, while it is cut short


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _scan_object(text: str, pos: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object opening at `pos` (key -> value start, value end or None), and
    the object's end, or None while it is incomplete."""
    members: dict[str, tuple[int, int | None]] = {}
    i = pos + 1
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i += 1
            continue
        try:
            key, i = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):  # not JSON, or an integer of too many digits
            return members, None
        i = _skip(text, i)
        if i >= len(text) or text[i] != ":":
            return members, None
        i = _skip(text, i + 1)
        if i >= len(text):
            return members, None
        try:
            _, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):  # not JSON, or an integer of too many digits
            members[str(key)] = (i, None)
            return members, None
        members[str(key)] = (i, end)
        i = end


def scan_required(text: str) -> tuple[list[CallScan], bool]:
    """The calls of a (partial) `required` output, and whether the array is complete."""
    calls: list[CallScan] = []
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "[":
        return calls, False
    i += 1
    while True:
        i = _skip(text, i)
        if i >= len(text):
            return calls, False
        if text[i] == "]":
            return calls, True
        if text[i] == ",":
            i += 1
            continue
        if text[i] != "{":
            return calls, False
        members, end = _scan_object(text, i)
        name = partial = None
        if "name" in members:
            start, stop = members["name"]
            if stop is not None:
                value = json.loads(text[start:stop])
                name = value if isinstance(value, str) else None
            elif text[start] == '"':  # NOTE: tool names need no escapes (letters, digits, _ -)
                partial = text[start + 1 :]
        arguments = members.get("arguments")
        calls.append(
            CallScan(
                name,
                arguments[0] if arguments else None,
                arguments[1] if arguments else None,
                partial,
            )
        )
        if end is None:
            return calls, False
        i = end


def _header(index: int, call_id: str, name: str) -> dict[str, Any]:
    function = {"name": name, "arguments": ""}
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": function}]
    }


def _fragment(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def complete_name(partial: str, names: tuple[str, ...]) -> str | None:
    """The one tool name that starts with `partial` (a call's name cut short; the grammar
    allows only the tools' names), or None when several or none do."""
    matches = [name for name in names if name.startswith(partial)]
    return matches[0] if len(matches) == 1 else None


class ToolCallStream:
    """One choice's deltas under a tool mode: `feed` each new piece of text, then `finish`.

    Both return OpenAI `delta` objects (`{"content": ...}` or `{"tool_calls": [...]}`);
    `has_calls` tells whether the choice made a call (finish_reason "tool_calls", or "length"
    for a forced call cut short, whose arguments are then what was written of them)."""

    def __init__(
        self,
        mode: str,
        parser: ToolParser,
        named: str | None,
        new_id,
        names: tuple[str, ...] = (),
    ) -> None:
        self.mode, self.parser, self.named, self._new_id = mode, parser, named, new_id
        self.names = names  # the tools' names, to complete a name cut short
        self.text = ""
        self._sent_content = 0  # characters of text sent as content (auto)
        self._ids: list[str] = []
        self._sent_args: list[int] = []  # per call: characters of its arguments sent
        self.has_calls = False

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        if self.mode == "named":
            return self._named(piece)
        if self.mode == "required":
            return self._required()
        if self.mode == "auto":
            return self._auto_content(final=False)
        return [{"content": piece}] if piece else []

    def finish(self, finish_reason: str | None = None) -> list[dict[str, Any]]:
        if self.mode == "required" and finish_reason == "length":
            return self._cut_call_header()
        if self.mode == "auto":
            parsed = self.parser.parse(self.text)
            if not parsed.tool_calls:
                return self._auto_content(final=True)
            return self._content_up_to(parsed.content) + self._whole_calls(parsed.tool_calls)
        return []

    def _named(self, piece: str) -> list[dict[str, Any]]:
        out = []
        if not self._ids:
            assert self.named is not None
            self._ids.append(self._new_id())
            self.has_calls = True
            out.append(_header(0, self._ids[0], self.named))
        if piece:
            out.append(_fragment(0, piece))
        return out

    def _required(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        calls, _ = scan_required(self.text)
        for k, call in enumerate(calls):
            if call.name is None:
                break
            if k == len(self._ids):
                self._ids.append(self._new_id())
                self._sent_args.append(0)
                self.has_calls = True
                out.append(_header(k, self._ids[k], call.name))
            if call.arguments_start is None:
                continue
            end = len(self.text) if call.arguments_end is None else call.arguments_end
            new = self.text[call.arguments_start + self._sent_args[k] : end]
            if new:
                self._sent_args[k] += len(new)
                out.append(_fragment(k, new))
        return out

    def _cut_call_header(self) -> list[dict[str, Any]]:
        """The header of a call whose name the token limit cut short, when the tools' names
        complete it (its arguments: none yet), as the whole answer reports it."""
        calls, _ = scan_required(self.text)
        if len(calls) <= len(self._ids) or calls[len(self._ids)].partial_name is None:
            return []
        name = complete_name(calls[len(self._ids)].partial_name or "", self.names)
        if name is None:
            return []
        self._ids.append(self._new_id())
        self._sent_args.append(0)
        self.has_calls = True
        return [_header(len(self._ids) - 1, self._ids[-1], name)]

    def _auto_content(self, final: bool) -> list[dict[str, Any]]:
        if final:
            safe = self.text
        else:
            # NOTE: whitespace before a call is not content (the parsers strip it), so trailing
            # whitespace waits until text follows it.
            safe = self.parser.content_before_marker(self.text)[0].rstrip(_WHITESPACE)
        return self._content_up_to(safe)

    def _content_up_to(self, safe: str) -> list[dict[str, Any]]:
        new = safe[self._sent_content :]
        self._sent_content = max(self._sent_content, len(safe))
        return [{"content": new}] if new else []

    def _whole_calls(self, calls: tuple[ParsedToolCall, ...]) -> list[dict[str, Any]]:
        self.has_calls = True
        out = []
        for k, call in enumerate(calls):
            self._ids.append(self._new_id())
            out.append(_header(k, self._ids[k], call.name))
            out.append(_fragment(k, call.arguments))
        return out
