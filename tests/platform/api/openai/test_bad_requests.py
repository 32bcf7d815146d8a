"""Bad requests get the right 4xx and an OpenAI-shaped error body; the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "hi"}]
C, CHAT = "/v1/completions", "/v1/chat/completions"


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


# (name, path, raw body, status, param, code)
CASES = [
    ("malformed JSON", C, b'{"prompt": "a",', 400, None, None),
    ("not an object", C, b"[1, 2, 3]", 400, None, None),
    ("invalid UTF-8", C, b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}', 400,
     None, None),
    ("lone surrogate", C, b'{"prompt": "\\ud800"}', 400, "prompt", None),
    ("deep nesting", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
     None),
    ("max_tokens as string", C, _json({"prompt": "a", "max_tokens": "5"}), 400, "max_tokens",
     None),
    ("temperature as string", CHAT, _json({"messages": USER, "temperature": "hot"}), 400,
     "temperature", None),
    ("seed as float", C, _json({"prompt": "a", "seed": 1.5}), 400, "seed", None),
    ("stream as string", C, _json({"prompt": "a", "stream": "yes"}), 400, "stream", None),
    ("prompt as number", C, _json({"prompt": 42}), 400, "prompt", None),
    ("messages as string", CHAT, _json({"messages": "hi"}), 400, "messages", None),
    ("message without role", CHAT, _json({"messages": [{"content": "hi"}]}), 400,
     "messages.0.role", None),
    ("unknown role", CHAT, _json({"messages": [{"role": "wizard", "content": "hi"}]}), 400,
     "messages.0.role", None),
    ("empty messages", CHAT, _json({"messages": []}), 400, "messages", None),
    ("empty prompt", C, _json({"prompt": ""}), 400, None, None),
    ("empty prompt list", C, _json({"prompt": []}), 400, "prompt", None),
    ("token id out of range", C, _json({"prompt": [10**9]}), 400, "prompt", None),
    ("negative max_tokens", C, _json({"prompt": "a", "max_tokens": -1}), 400, "max_tokens",
     None),
    ("zero max_completion_tokens", CHAT, _json({"messages": USER, "max_completion_tokens": 0}),
     400, "max_tokens", None),
    ("temperature above 2", C, _json({"prompt": "a", "temperature": 2.5}), 400, "temperature",
     None),
    ("top_p of 0", CHAT, _json({"messages": USER, "top_p": 0.0}), 400, "top_p", None),
    ("presence_penalty above 2", C, _json({"prompt": "a", "presence_penalty": 3}), 400,
     "presence_penalty", None),
    ("huge top_k", C, _json({"prompt": "a", "top_k": 10**20}), 400, "top_k", None),
    ("n of 0", C, _json({"prompt": "a", "n": 0}), 400, "n", None),
    ("n of 10000", C, _json({"prompt": "a", "n": 10_000}), 400, "n", None),
    ("logprobs above 20", C, _json({"prompt": "a", "logprobs": 50}), 400, "logprobs", None),
    ("top_logprobs without logprobs", CHAT, _json({"messages": USER, "top_logprobs": 2}), 400,
     "top_logprobs", None),
    ("too many stop strings", C, _json({"prompt": "a", "stop": ["x"] * 20}), 400, "stop", None),
    ("unsupported schema feature", CHAT,
     _json({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "n", "schema": {"type": "integer", "not": {"const": 7}}}}}), 400,
     None, "unsupported_schema_feature"),
    ("empty guided_choice", C, _json({"prompt": "a", "guided_choice": []}), 400,
     "guided_choice", None),
    ("oversized prompt", C, _json({"prompt": "hello " * 600}), 400, "prompt",
     "context_length_exceeded"),
    ("oversized chat", CHAT, _json({"messages": [{"role": "user", "content": "hi " * 600}]}),
     400, "messages", "context_length_exceeded"),
    ("prompt plus max_tokens beyond context", C,
     _json({"prompt": "a", "max_tokens": 10_000}), 400, "max_tokens",
     "context_length_exceeded"),
    ("unknown model", CHAT, _json({"model": "gpt-9", "messages": USER}), 404, "model",
     "model_not_found"),
    ("body of 5 MB", C, _json({"prompt": "x" * (5 * 1024 * 1024)}), 413, None,
     "request_too_large"),
]  # fmt: skip


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "raw", "status", "param", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_request_gets_its_4xx(http, path, raw, status, param, code):
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and isinstance(error["type"], str)
    assert error["param"] == param
    assert error["code"] == code


def test_context_errors_name_the_limit(http):
    response = http.post(C, json={"prompt": "a", "max_tokens": 10_000})
    assert "512" in response.json()["error"]["message"]


def test_unknown_routes_and_methods_answer_in_openai_shape(http):
    assert http.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    response = http.get(C)
    assert response.status_code == 405
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_fields_are_ignored(http):
    body = {"prompt": "Hello", "max_tokens": 2, "some_future_field": {"x": 1}, "user": "u1"}
    assert http.post(C, json=body).status_code == 200


def test_the_server_keeps_serving_after_bad_requests(http, server):
    for _, path, raw, *_ in CASES:
        http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert http.get("/health").json() == {"status": "ok"}
    response = http.post(CHAT, json={"model": server.model, "messages": USER, "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"]


def test_a_tool_call_with_a_huge_integer_in_its_arguments_is_rendered(http):
    """An earlier turn's call arguments are JSON text the client wrote: an integer of 5000
    digits in them reaches the template as text (here too long for the context), not a 500."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"x": ' + "9" * 5000 + "}"}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]  # fmt: skip
    body = {"messages": messages, "tools": tools, "max_tokens": 2}
    response = http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    call["function"]["arguments"] = '{"x": ' + "9" * 50 + "}"
    assert http.post(CHAT, json=body).status_code == 200
