"""A streamed request that can be refused is refused with a 4xx JSON error before the stream
starts, never with a 200 followed by an error event."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from api_helpers import wait_until_idle

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# (name, path, body, status, code)
CASES = [
    ("invalid regex", C, {"prompt": "Hi", "guided_regex": "(["}, 400,
     "invalid_structured_output"),
    ("invalid regex, chat", CHAT, {"messages": USER, "guided_regex": "(["}, 400,
     "invalid_structured_output"),
    ("invalid regex, two prompts", C, {"prompt": ["Hi", "Ho"], "guided_regex": "(["}, 400,
     "invalid_structured_output"),
    ("schema nested 150 levels", CHAT,
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "deep", "schema": _nested_schema(150)}}}, 400, None),
    ("prompt too long", C, {"prompt": "hello " * 600}, 400, "context_length_exceeded"),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": USER}, 404, "model_not_found"),
    ("n above --max-n", C, {"prompt": "Hi", "n": 17}, 400, None),
]  # fmt: skip


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body", "status", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_refused_stream_answers_4xx_json_before_any_event(http, path, body, status, code):
    start = time.monotonic()
    response = http.post(path, json={**body, "stream": True, "max_tokens": 4})
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    if code is not None:
        assert error["code"] == code
    assert time.monotonic() - start < 20


def test_a_non_finite_number_in_a_streamed_request_answers_400(http):
    raw = b'{"prompt": "Hi", "stream": true, "temperature": NaN}'
    response = http.post(C, content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "non-finite" in response.json()["error"]["message"]


def test_a_valid_stream_still_streams_and_nothing_is_left_running(http, server):
    body = {"prompt": "Hi", "stream": True, "max_tokens": 3, "guided_regex": "[a-z]+"}
    with http.stream("POST", C, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all('"error"' not in event for event in events)
    metrics = wait_until_idle(server.base_url)
    assert metrics["loraplex:num_requests_running"] == 0
    assert metrics["loraplex:num_kv_blocks_free"] == metrics["loraplex:num_kv_blocks_total"]


def test_a_spec_too_deep_to_analyse_at_admission_is_a_400_not_a_500():
    """Whatever the engine's add_request raises for a spec (a GrammarError, a ValueError, or a
    RecursionError from a too-deep analysis) answers 400."""
    from loraplex.platform.api.errors import APIError
    from loraplex.platform.api.openai.request_streams import Prompt, submit
    from loraplex.platform.core.sampling_params import SamplingParams

    class _Refusing:
        def __init__(self, error: Exception) -> None:
            self.error = error

        async def add_request(self, *args, **kwargs):
            raise self.error

    for error in (RecursionError("deep"), ValueError("bad spec")):
        with pytest.raises(APIError) as info:
            asyncio.run(submit(_Refusing(error), [Prompt("x", [1])], SamplingParams(), "r"))
        assert info.value.status == 400
