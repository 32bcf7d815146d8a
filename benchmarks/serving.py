"""Serving benchmark in the manner of `vllm bench serve`.

N random token-id prompts of --input-len tokens, each asking for exactly --output-len tokens
(ignore_eos), sent to /v1/completions with streaming at a request rate (Poisson arrivals) or a
fixed concurrency. Reports request throughput, output tokens/s, and TTFT, TPOT and ITL at
p50/p90/p99. `--offline` runs the same workload through `LLM.generate`. `--sampling` picks greedy
or `t1` (temperature 1.0, top_p 1: the openai SDK's default); `--record` runs both, the t1
metrics named with a `t1_` prefix.

    # against a running server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --max-concurrency 8
    # the same workload offline
    python benchmarks/serving.py --offline
    # launch a server, run concurrency 1, 8 and 32 and offline, write the results JSON
    python benchmarks/serving.py --record --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "cpu_serving.json"
# Sampling mode -> (temperature, top_p) of every request; the metric prefix is "" or "t1_".
SAMPLINGS = {"greedy": (0.0, 1.0), "t1": (1.0, 1.0)}


def make_prompts(num: int, input_len: int, seed: int) -> list[list[int]]:
    """Random token-id prompts, away from the special tokens at the start of the vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(input_len)] for _ in range(num)]


@dataclass
class RequestResult:
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else float("nan")


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
            metrics[f"{name}_p{q}_ms"] = _pct(values, q)
    return metrics


async def _one_request(
    client, model: str, prompt: list[int], output_len: int, sampling: str = "greedy"
) -> RequestResult:
    temperature, top_p = SAMPLINGS[sampling]
    start = time.perf_counter()
    last = start
    result: RequestResult | None = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        temperature=temperature,
        top_p=top_p,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None and result is not None:
            result.output_tokens = chunk.usage.completion_tokens
        if not chunk.choices or not chunk.choices[0].text:
            continue
        if result is None:
            result = RequestResult(ttft_s=now - start)
        else:
            result.itl_s.append(now - last)
        last = now
    if result is None:
        raise RuntimeError("a request produced no output")
    result.e2e_s = time.perf_counter() - start
    return result


async def run_server_benchmark(
    base_url: str,
    prompts: list[list[int]],
    output_len: int,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    sampling: str = "greedy",
) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                timeout=3600)  # fmt: skip
    model = (await client.models.list()).data[0].id
    await _one_request(client, model, prompts[0][:8], 2)  # warm-up
    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    rng = np.random.default_rng(seed)

    async def limited(prompt: list[int]) -> RequestResult:
        async with limit:
            return await _one_request(client, model, prompt, output_len, sampling)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(limited(prompt)))
        if request_rate != float("inf"):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    await client.close()
    return summarize(list(results), duration)


def run_offline_benchmark(
    prompts: list[list[int]], output_len: int, samplings: tuple[str, ...] = ("greedy",)
) -> dict[str, dict[str, float]]:
    """The same workload through LLM.generate (one engine, one batch per sampling mode):
    throughput only, by sampling mode."""
    from loraplex import LLM, SamplingParams

    llm = LLM()
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up
    runs = {}
    for sampling in samplings:
        temperature, top_p = SAMPLINGS[sampling]
        params = SamplingParams(
            max_tokens=output_len, temperature=temperature, top_p=top_p, ignore_eos=True
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        duration = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs[sampling] = {
            "completed": len(outputs),
            "duration_s": duration,
            "request_throughput": len(outputs) / duration,
            "output_tok_s": out_tokens / duration,
        }
    return runs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_server(extra_args: list[str]) -> tuple[subprocess.Popen, str]:
    """`loraplex serve` on a free loopback port; returns once /health answers."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port),
           "--uvicorn-log-level", "warning", *extra_args]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not start within 300 s")


def record(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Server runs at each --concurrency, then offline, greedy and t1; the flat metrics of the
    results JSON (greedy's unprefixed, t1's prefixed `t1_`)."""
    metrics: dict[str, float] = {}
    samplings = tuple(SAMPLINGS)
    proc, base_url = launch_server(args.server_arg or [])
    try:
        for sampling in samplings:
            pre = _prefix(sampling)
            for c in args.concurrency:
                metrics[f"{pre}c{c}_load_avg_1m"] = os.getloadavg()[0]
                run = asyncio.run(run_server_benchmark(base_url, prompts, args.output_len, c,
                                                       float("inf"), args.seed, sampling))  # fmt: skip
                print(f"{sampling} concurrency {c}: {json.dumps(run)}", flush=True)
                metrics.update({f"{pre}c{c}_{k}": v for k, v in run.items()})
    finally:
        proc.terminate()
        proc.wait(30)
    metrics["offline_load_avg_1m"] = os.getloadavg()[0]
    offline = run_offline_benchmark(prompts, args.output_len, samplings)
    for sampling, run in offline.items():
        print(f"{sampling} offline: {json.dumps(run)}", flush=True)
        metrics.update({f"{_prefix(sampling)}offline_{k}": v for k, v in run.items()})
    for sampling in samplings:
        pre = _prefix(sampling)
        for c in args.concurrency:
            metrics[f"{pre}server_vs_offline_c{c}"] = (
                metrics[f"{pre}c{c}_output_tok_s"] / metrics[f"{pre}offline_output_tok_s"]
            )
    metrics["t1_vs_greedy_offline"] = (
        metrics["t1_offline_output_tok_s"] / metrics["offline_output_tok_s"]
    )
    return metrics


def _prefix(sampling: str) -> str:
    return "" if sampling == "greedy" else f"{sampling}_"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline", action="store_true", help="run the workload through LLM instead")
    p.add_argument("--sampling", choices=tuple(SAMPLINGS), default="greedy",
                   help="greedy, or t1: temperature 1.0, top_p 1 (--record runs both)")  # fmt: skip
    p.add_argument(
        "--record",
        action="store_true",
        help="launch a server, run --concurrency levels and offline, write --out",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument(
        "--server-arg",
        action="append",
        help="an extra `loraplex serve` argument for --record (repeatable)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="the results JSON (--record)")
    p.add_argument("--device", default="cpu", help="the device, as written into the results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    if args.record:
        load = os.getloadavg()
        metrics = record(args, prompts)
        result = {
            "benchmark": "serving",
            "device": args.device,
            "command": " ".join(["python", "benchmarks/serving.py", *sys.argv[1:]]),
            "commit": _commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                         "output_len": args.output_len, "load_avg_at_start": load},
            "metrics": metrics,
            "baseline": "the same workload through the offline API (LLM.generate, one batch); "
            "server_vs_offline_cN = server output tok/s at concurrency N / offline output tok/s",
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
        return 0
    if args.offline:
        metrics = run_offline_benchmark(prompts, args.output_len, (args.sampling,))[args.sampling]
    else:
        metrics = asyncio.run(run_server_benchmark(args.base_url, prompts, args.output_len,
                                                   args.max_concurrency, args.request_rate,
                                                   args.seed, args.sampling))  # fmt: skip
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
