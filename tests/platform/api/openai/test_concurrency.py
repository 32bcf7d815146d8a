"""Many streams at once, and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import json

import httpx
from api_helpers import read_metrics, wait_until_idle

from loraplex import SamplingParams

NUM_CONCURRENT = 64
MAX_TOKENS = 8


async def _stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> str:
    parts = []
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            parts.extend(c["text"] for c in json.loads(line[6:])["choices"])
    return "".join(parts)


def test_64_concurrent_streams_match_the_offline_api(server, offline_llm):
    prompts = [f"Item {i}: a short note about the number {i * 7} is" for i in range(NUM_CONCURRENT)]

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=NUM_CONCURRENT + 8)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            url = f"{server.v1}/completions"
            body = {"model": server.model, "max_tokens": MAX_TOKENS, "temperature": 0}
            return await asyncio.gather(
                *(_stream_completion(client, url, {**body, "prompt": p}) for p in prompts)
            )

    served = asyncio.run(run())
    offline = offline_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert served == [o.outputs[0].text for o in offline]
    assert all(served)


def test_a_client_leaving_mid_stream_aborts_its_request(server):
    before = read_metrics(server.base_url)
    long_body = {"model": server.model, "prompt": "Count slowly:", "max_tokens": 400,
                 "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip

    async def leave_early(client: httpx.AsyncClient) -> int:
        chunks = 0
        async with client.stream("POST", f"{server.v1}/completions", json=long_body) as resp:
            async for line in resp.aiter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:
                    break
        return chunks

    async def run() -> tuple[int, list[str]]:
        async with httpx.AsyncClient(timeout=300) as client:
            short = {"model": server.model, "max_tokens": 12, "temperature": 0}
            others = [
                _stream_completion(client, f"{server.v1}/completions", {**short, "prompt": p})
                for p in ("Red", "Green", "Blue")
            ]
            return await asyncio.gather(leave_early(client), asyncio.gather(*others))

    chunks, others = asyncio.run(run())
    assert chunks == 3 and all(others)
    after = wait_until_idle(server.base_url)
    assert after["loraplex:num_kv_blocks_free"] == after["loraplex:num_kv_blocks_total"]
    aborted = after.get("loraplex:request_success_total|abort", 0)
    assert aborted == before.get("loraplex:request_success_total|abort", 0) + 1
    generated = (
        after["loraplex:generation_tokens_total"] - before["loraplex:generation_tokens_total"]
    )
    assert generated < 400


def test_a_non_streaming_client_that_times_out_aborts_its_request(server):
    before = read_metrics(server.base_url)
    body = {"model": server.model, "prompt": "Count slowly:", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    try:
        httpx.post(f"{server.v1}/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    after = wait_until_idle(server.base_url)
    assert after["loraplex:num_kv_blocks_free"] == after["loraplex:num_kv_blocks_total"]
    aborted = after.get("loraplex:request_success_total|abort", 0)
    assert aborted == before.get("loraplex:request_success_total|abort", 0) + 1
