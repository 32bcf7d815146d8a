"""The serving benchmarks' client and clock. `lean_client_run`: a streaming client of the
OpenAI completions API light enough not to bend the server's figures (aiohttp, a timestamp and a
JSON parse per event, in a process of its own). `StreamTimer` and `summarize`: TTFT, TPOT and
inter-token latency per request, throughput and percentiles over a run."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field

from benchmarks.common.sampling_mixes import mix_fields
from benchmarks.common.stats import quantile


@dataclass
class RequestResult:
    """One streamed request's figures, in seconds: first token, gaps after it, end to end."""

    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0


class StreamTimer:
    """One streamed request's clock: TTFT at its first non-empty chunk, then inter-token gaps."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.result: RequestResult | None = None

    def chunk(self, text: str, completion_tokens: int | None) -> None:
        now = time.perf_counter()
        if completion_tokens is not None and self.result is not None:
            self.result.output_tokens = completion_tokens
        if not text:
            return
        if self.result is None:
            self.result = RequestResult(ttft_s=now - self.start)
        else:
            self.result.itl_s.append(now - self.last)
        self.last = now

    def finish(self) -> RequestResult:
        if self.result is None:
            raise RuntimeError("a request produced no output")
        self.result.e2e_s = time.perf_counter() - self.start
        return self.result


def _percentile_ms(values: list[float], percent: int) -> float:
    return quantile(values, percent / 100) * 1000


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, float]:
    """Throughput and latency percentiles (milliseconds) over finished requests."""
    out_tokens = sum(r.output_tokens for r in results)
    ttft = [r.ttft_s for r in results]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    itl = [gap for r in results for gap in r.itl_s]
    metrics = {
        "completed": len(results),
        "duration_s": duration_s,
        "request_throughput": len(results) / duration_s,
        "output_tok_s": out_tokens / duration_s,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            metrics[f"{name}_p{q}_ms"] = _percentile_ms(values, q)
    return metrics


async def _lean_load(
    base_url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
    sampling: str, request_rate: float = math.inf, seed: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Stream every prompt through /v1/completions, at most `concurrency` at a time, with
    aiohttp and nothing else per event than a timestamp and a JSON parse. `request_rate`
    (requests/s): Poisson arrivals (exponential gaps drawn from `seed`), each request timed from
    its arrival; inf: all at once."""
    import aiohttp

    url = f"{base_url}/v1/completions"
    limit = asyncio.Semaphore(concurrency)

    async def one(
        session: aiohttp.ClientSession, prompt: list[int], i: int, max_tokens: int = output_len
    ) -> RequestResult:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
                **mix_fields(sampling, i)}  # fmt: skip
        async with limit:
            timer = StreamTimer()
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"stream error: {event['error']}")
                    usage = event["usage"]["completion_tokens"] if event.get("usage") else None
                    timer.chunk(event["choices"][0]["text"] if event["choices"] else "", usage)
            return timer.finish()

    async def arriving(session: aiohttp.ClientSession, prompt: list[int], i: int, at: float):
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        return await one(session, prompt, i)

    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await one(session, prompts[0][:8], 0, max_tokens=2)  # warm-up (the connection)
        start = time.perf_counter()
        if math.isinf(request_rate):
            runs = [one(session, p, i) for i, p in enumerate(prompts)]
        else:
            gaps = random.Random(seed).expovariate
            arrivals = list(itertools.accumulate(gaps(request_rate) for _ in prompts))
            runs = [arriving(session, p, i, start + at) for i, (p, at) in
                    enumerate(zip(prompts, arrivals))]  # fmt: skip
        results = await asyncio.gather(*runs)
        duration = time.perf_counter() - start
    return summarize(list(results), duration)


def _lean_client_main(conn, *args) -> None:
    """The client process: one load per message (a tuple of `_lean_load`'s arguments) until
    None, answering each with its metrics and the process's CPU seconds so far
    (`client_cpu_s`), or the exception it raised."""
    import resource

    while (load := conn.recv()) is not None:
        try:
            metrics = asyncio.run(_lean_load(*load))
            usage = resource.getrusage(resource.RUSAGE_SELF)
            metrics["client_cpu_s"] = usage.ru_utime + usage.ru_stime
            conn.send(metrics)
        except BaseException as error:  # reported to the parent, which raises it
            conn.send(error)


class LeanClient:
    """The lean client in a process of its own (it shares no core's GIL with the benchmark
    driver), kept for several loads: `run(*args)` is `_lean_load(*args)` there."""

    def __init__(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_lean_client_main, args=(child,))
        self._process.start()

    def run(self, *args) -> dict[str, float]:
        self._conn.send(args)
        result = self._conn.recv()
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
        self._process.join(30)

    def __enter__(self) -> LeanClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lean_client_run(*args) -> dict[str, float]:
    """`_lean_load(*args)` in a client process of its own (see `LeanClient`); its metrics and
    the client process's CPU seconds (`client_cpu_s`)."""
    with LeanClient() as client:
        return client.run(*args)
