"""OpenAI fields we do not serve answer a 400 that names them, never a silently different
answer; bad tool specs are 400s too."""

from __future__ import annotations

import httpx
import pytest

CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

CHAT_CASES = [
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), CHAT_CASES, ids=[p for _, p in CHAT_CASES])
def test_chat_refuses_what_it_does_not_serve(server, extra, param):
    body = {"model": server.model, "messages": CHAT, "max_tokens": 1, **extra}
    reply = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


RESPONSES_CASES = [
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param"), RESPONSES_CASES, ids=[p for _, p in RESPONSES_CASES])
def test_responses_refuse_what_they_do_not_serve(server, extra, param):
    body = {"model": server.model, "input": "hi", "max_output_tokens": 1, **extra}
    reply = httpx.post(f"{server.v1}/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_unknown_response_id_is_a_404(server):
    reply = httpx.get(f"{server.v1}/responses/resp_nope", timeout=60)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "response_not_found"
