"""The multi-process server's faults and shutdown: the engine core killed mid-stream, and
SIGTERM with 16 streams in flight. Each test starts its own `loraplex serve` and ends it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from datetime import datetime

import httpx

from benchmarks.common.server_launch import free_port
from tests.platform.api.process_server import alive, launch
from tests.waiting import wait_until

# SIGTERM's grace period, and streams that fit in it and that do not (1500 steps take longer
# than 12 s even on a fast CPU; a longer grace period only made the test wait longer)
GRACE_S, SHORT, LONG = 12, 3, 1500


async def _stream(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event):
    """(finish reason or None, error or None, saw [DONE], the time it ended). The error is the
    error event's, or the body's of a 503 answered before the stream began (it had no token
    yet); [DONE] counts as seen then too."""
    error, done, finish = None, False, None
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code == 503:
            return None, json.loads(await response.aread())["error"], True, time.monotonic()
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                else:
                    finish = event["choices"][0]["finish_reason"] or finish
                    started.set()
    return finish, error, done, time.monotonic()


def _body(model: str, max_tokens: int, i: int) -> dict:
    return {"model": model, "prompt": f"Request {i}:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


def test_killing_the_engine_mid_stream_fails_every_stream_fast(model_dir, tmp_path):
    served = launch(model_dir, tmp_path / "serve.log", 2)
    pids = served.all_pids()
    engine_pid, _ = served.pids()
    try:

        async def run():
            started = asyncio.Event()
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [
                    asyncio.ensure_future(
                        _stream(
                            client, f"{served.v1}/completions", _body(served.model, 400, i), started
                        )  # fmt: skip
                    )
                    for i in range(4)
                ]
                await asyncio.wait_for(started.wait(), 120)
                killed_at = time.monotonic()
                os.kill(engine_pid, signal.SIGKILL)
                results = await asyncio.gather(*tasks)
                # /health says 503 while the API processes wait to exit
                health = await client.get(f"{served.base_url}/health")
            return killed_at, results, health.status_code

        killed_at, results, health = asyncio.run(run())
        for _finish, error, done, ended_at in results:
            assert error is not None and error["code"] == "engine_dead" and done
            assert ended_at - killed_at < 5.0
        assert health == 503
        assert served.proc.wait(30) == 1
        wait_until(lambda: alive(pids) == [], 10, "every server process to exit")
    finally:
        served.stop(signal.SIGKILL)


def test_sigterm_drains_16_streams_then_every_process_exits(model_dir, tmp_path):
    # 12 streams short enough to finish within the grace period; 4 far longer ones end with a
    # clean 503 error event when it is over.
    served = launch(
        model_dir, tmp_path / "serve.log", 2, "--shutdown-timeout", str(GRACE_S), max_model_len=2048
    )
    pids = served.all_pids()
    try:

        async def run():
            started = [asyncio.Event() for _ in range(16)]
            async with httpx.AsyncClient(timeout=300) as client:
                tasks = [
                    asyncio.ensure_future(
                        _stream(client, f"{served.v1}/completions",
                                _body(served.model, SHORT if i < 12 else LONG, i), started[i])
                    )
                    for i in range(16)
                ]  # fmt: skip
                # every stream has its first token: all 16 are in flight
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
                served.proc.send_signal(signal.SIGTERM)
                signalled_at = time.monotonic()
                results = await asyncio.gather(*tasks)
            return signalled_at, results

        signalled_at, results = asyncio.run(run())
        short, long = results[:12], results[12:]
        assert all(
            error is None and done and finish == "length" for finish, error, done, _ in short
        ), short
        for finish, error, done, ended_at in long:
            assert error is not None and error["code"] == "engine_dead" and done
            assert "shutting down" in error["message"]
            assert finish is None and ended_at - signalled_at < GRACE_S + 10
        assert served.proc.wait(60) == 0
        wait_until(lambda: alive(pids) == [], 10, "every server process to exit")
    finally:
        served.stop(signal.SIGKILL)


def test_health_answers_only_once_the_engine_is_warm(tiny_llama_dir, tmp_path, monkeypatch):
    # The warm-up runs on CUDA by default; LORAPLEX_WARM_UP=1 runs it on CPU too.
    monkeypatch.setenv("LORAPLEX_WARM_UP", "1")
    port = free_port()
    answers: list[tuple[float, int]] = []  # (time.time(), status) of every /health answered
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5).status_code
                answers.append((time.time(), status))
            except httpx.HTTPError:
                pass
            stop.wait(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        served = launch(tiny_llama_dir, tmp_path / "serve.log", 2, port=port)
    finally:
        stop.set()
        poller.join(10)
    try:
        log = served.log()
        warm = re.search(r"^(\S+ \S+) \S+ INFO warmed up: (\d+) requests", log, re.MULTILINE)
        assert warm, log
        warmed_at = datetime.strptime(warm[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        assert int(warm[2]) > 0
        ready = [at for at, status in answers if status == 200]
        assert ready and min(ready) >= warmed_at
        assert re.search(r"engine core ready [\d.]+ s after its start", log)
    finally:
        assert served.stop() == 0, served.log()
