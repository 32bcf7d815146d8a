"""Hostile JSON schemas over HTTP: a 400 naming the limit within a couple of seconds, never a 500,
while another tenant's stream keeps getting tokens."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.waiting import wait_until

sys.path.insert(0, str(Path(__file__).parents[3] / "grammar"))
from hostile_schemas import nested, wide  # noqa: E402

# The 100,000-property body is 2.9 MB: parsing it alone takes about half a second on a busy
# 2-core machine. What the bound excludes is the 10-100 s the engine spent on it before.
MAX_SECONDS = 5.0


def _schema_body(server, schema: dict) -> bytes:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": 8,
        "response_format": response_format,
    }
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("schema", "limit"),
    [(wide(100_000), "max_schema_nodes"), (nested(150), "max_schema_depth")],
    ids=["100k-properties", "150-levels"],
)
def test_hostile_schema_is_a_quick_400_while_another_stream_flows(server, schema, limit):
    raw = _schema_body(server, schema)
    times: list[float] = []
    done = threading.Event()
    other = {
        "model": server.model,
        "prompt": "Count slowly:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }

    def stream() -> None:
        with httpx.stream("POST", f"{server.v1}/completions", json=other, timeout=300) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                if done.is_set():
                    return  # closing the stream aborts the request

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    wait_until(lambda: len(times) >= 3, 60, "the other stream to start")
    start = time.monotonic()
    reply = httpx.post(
        f"{server.v1}/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert limit in error["message"] and error["type"] == "invalid_request_error"
    assert elapsed < MAX_SECONDS
    got = len(times)
    wait_until(lambda: len(times) > got, 10, "the other stream to go on (it stalled)")
    done.set()
    thread.join(60)


def test_schema_too_deep_for_any_recursive_reader_is_a_400_not_a_500(server):
    raw = '{"type": "object", "properties": {"a": ' * 3000 + "{}" + "}}" * 3000
    head = f'{{"model": "{server.model}", "prompt": "x", "max_tokens": 4, "guided_json": '
    body = head + raw + "}"
    reply = httpx.post(
        f"{server.v1}/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text[:500]
    assert json.loads(reply.text)["error"]["message"]
