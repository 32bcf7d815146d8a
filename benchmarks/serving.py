"""Serving benchmark in the manner of `vllm bench serve`.

N random token-id prompts of --input-len tokens, each asking for exactly --output-len tokens
(ignore_eos), sent to /v1/completions with streaming at a request rate (Poisson arrivals) or a
fixed concurrency. Reports request throughput, output tokens/s, and TTFT, TPOT and ITL at
p50/p90/p99. `--offline` runs the same workload through `LLM.generate`. `--sampling` picks greedy,
`t1` (temperature 1.0, top_p 1: the openai SDK's default) or `mixed` (request i takes mix i mod
9 of `benchmarks.common.sampling_mixes`: penalties, top-k/p, min-p, seeds, logprobs); `--record` runs all
three, their metrics named with a `t1_` / `mixed_` prefix.

    # against a running server
    python -m benchmarks.serving --base-url http://127.0.0.1:8000 --max-concurrency 8
    # the same workload offline
    python -m benchmarks.serving --offline
    # launch a server, run concurrency 1, 8 and 32 and offline, write the results JSON
    python -m benchmarks.serving --record --concurrency 1 8 32
    # the GPU record: the 8B shape with random weights served by `loraplex
    # serve` at its default flags (engine-core process + the API processes its default chose),
    # a lean aiohttp streaming client in its own process: the first burst after start-up, then
    # concurrency 1, 64 and 256, then steady Poisson arrivals at 50 % and 90 % of the request
    # rate sustained at 256, then the first burst again; then the offline LLM on the same engine
    # options; greedy, t1 and mixed (not at concurrency 1); start-up time to /health; writes
    # benchmarks/results/h200_serving.json (about 4 minutes on the H200 with these sizes)
    python -m benchmarks.serving --gpu-record --num-prompts 512 --input-len 256 \
        --output-len 128 --concurrency 1 64 256 --poisson-prompts 512
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

from benchmarks.common.prompts import mix_params, serving_prompts
from benchmarks.common.sampling_mixes import MIXED, mix_fields
from benchmarks.common.server_launch import launch_server, serve_flags
from benchmarks.common.stream_client import (
    LeanClient,
    RequestResult,
    StreamTimer,
    summarize,
)
from benchmarks.record import write_result

# The engine options of both sides of the GPU record: the benchmark engine's, with these batch
# limits; on a CPU host the embedded model's.
GPU_BATCH_LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=2048)
CPU_ENGINE = dict(dtype="float32", device="cpu", max_model_len=512, enable_lora=False, seed=0,
                  max_num_seqs=64, max_num_batched_tokens=2048)  # fmt: skip
# Sampling modes: greedy, t1 (temperature 1.0, top_p 1: the openai SDK's default) and mixed
# (request i takes the (i mod 9)-th of the sampling mixes); the metric prefix is "",
# "t1_" or "mixed_". Each request's fields come from `mix_fields`.
SAMPLINGS = ("greedy", "t1", MIXED)
# Steady arrivals of the GPU record: Poisson, at these percents of the request rate the server
# sustained at its highest concurrency.
POISSON_PERCENTS = (50, 90)
# What the GPU record keeps of its two timed bursts (the first after start-up, one at the end).
BURST_FIGURES = ("duration_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
# Request fields the openai SDK takes as arguments; the others (top_k, min_p,
# repetition_penalty) travel in extra_body, as vLLM's extensions do.
_SDK_FIELDS = {"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logprobs"}


async def _one_request(
    client, model: str, prompt: list[int], output_len: int, sampling: str = "greedy", i: int = 0
) -> RequestResult:
    fields = mix_fields(sampling, i)
    extra = {k: v for k, v in fields.items() if k not in _SDK_FIELDS}
    timer = StreamTimer()
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_len,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **extra},
        **{k: v for k, v in fields.items() if k in _SDK_FIELDS},
    )
    async for chunk in stream:
        usage = chunk.usage.completion_tokens if chunk.usage is not None else None
        timer.chunk(chunk.choices[0].text if chunk.choices else "", usage)
    return timer.finish()


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

    async def limited(prompt: list[int], i: int) -> RequestResult:
        async with limit:
            return await _one_request(client, model, prompt, output_len, sampling, i)

    start = time.perf_counter()
    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(limited(prompt, i)))
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
        params = mix_params(sampling, [output_len] * len(prompts))
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


def record(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Server runs at each --concurrency, then offline, for each sampling mode; the flat metrics
    of the results JSON (greedy's unprefixed, the others prefixed `t1_` / `mixed_`)."""
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


def offline_runs(
    llm, prompts: list[list[int]], output_len: int, concurrency: int, sampling: str
) -> float:
    """Offline output tok/s with at most `concurrency` requests in flight: waves of that many
    (every request has the same lengths, so waves are what continuous batching runs too)."""
    from benchmarks.common.timing import wall_seconds

    params = mix_params(sampling, [output_len] * len(prompts))
    llm.generate(prompts[:concurrency], mix_params(sampling, [4] * concurrency))
    llm.engine.scheduler.kv.reset_prefix_cache()
    starts = range(0, len(prompts), concurrency)
    seconds = wall_seconds(lambda: [llm.generate(prompts[i : i + concurrency],
                                               params[i : i + concurrency], use_tqdm=False)
                                  for i in starts])  # fmt: skip
    return len(prompts) * output_len / seconds


def offline_tpot(llm, prompts: list[list[int]], output_len: int, sampling: str) -> float:
    """Seconds per output token of one request alone: (time of output_len tokens - time of
    one) / (output_len - 1), the median over `prompts` (the server's c1 TPOT, offline)."""
    from benchmarks.common.timing import wall_seconds
    from loraplex import SamplingParams

    fields = mix_fields(sampling, 0)

    def timed(prompt: list[int], n: int) -> float:
        params = SamplingParams(max_tokens=n, ignore_eos=True, **fields)
        return wall_seconds(lambda: llm.generate([prompt], params, use_tqdm=False))

    timed(prompts[0], 8)
    tpots = [(timed(p, output_len) - timed(p, 1)) / (output_len - 1) for p in prompts]
    return float(np.median(tpots))


def record_gpu(args: argparse.Namespace) -> dict[str, float]:
    """The GPU record, the server at its default flags (but the engine options both sides
    share): start-up time; the first heavy burst after start-up and the same burst at the end;
    server (lean client, concurrency args.concurrency) and offline, greedy, t1 and mixed (mixed
    not at concurrency 1); steady Poisson arrivals (greedy) at 50 % and 90 % of the request rate
    the server sustained at the highest concurrency. Flat metrics, the sampled modes' with a
    `_t1` / `_mixed` suffix (`server_vs_offline_c256_t1`)."""
    import torch

    from benchmarks.common.engine import BENCH_ENGINE, bench_llm, resolve_model
    from benchmarks.common.model_folders import with_word_tokenizer
    from loraplex.entrypoints.launcher import default_api_server_count

    on_cpu = not torch.cuda.is_available()
    model = resolve_model(args.model or (None if on_cpu else "llama-3.1-8b"))
    if model is not None and model.endswith(".json"):
        model = with_word_tokenizer(model)
    options = dict(CPU_ENGINE) if on_cpu else {**BENCH_ENGINE, **GPU_BATCH_LIMITS}
    flags = serve_flags(options) + (["--model", model] if model else [])
    if args.api_server_count:
        flags += ["--api-server-count", str(args.api_server_count)]
    # NOTE: what `loraplex serve` chooses on this host when not told (same rule, same cores)
    metrics: dict[str, float] = {
        "api_server_count": args.api_server_count or default_api_server_count()
    }
    sets = iter(range(1, 1000))  # a fresh prompt set per run: no prefix-cache hits across runs

    def fresh(num: int) -> list[list[int]]:
        return serving_prompts(num, args.input_len, args.seed + 1000 * next(sets))

    def prompts_for(c: int) -> list[list[int]]:
        return fresh(args.c1_prompts if c == 1 else args.num_prompts)

    # NOTE: on a CPU host the offline engine fits beside the server, and each offline run
    # goes right after the server run it is compared with: a shared host's load drifts by
    # minutes, and a ratio of two runs far apart measures the drift. On a GPU the server
    # stops first (one engine's memory at a time).
    llm = bench_llm(model, **options) if on_cpu else None
    top = max(args.concurrency)
    burst = args.burst_requests or top
    pairs = [(sampling, c) for sampling in SAMPLINGS for c in args.concurrency
             if not (sampling == MIXED and c == 1)]  # fmt: skip
    started = time.perf_counter()
    proc, base_url = launch_server(flags)
    metrics["startup_s"] = time.perf_counter() - started
    try:
        import httpx

        served = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        with LeanClient() as client:

            def load(prompts, output_len, c, sampling, rate=float("inf")) -> dict[str, float]:
                return client.run(base_url, served, prompts, output_len, c, sampling, rate,
                                  args.seed)  # fmt: skip

            # NOTE: timed, the server's first heavy batch after start-up (no untimed warm-up:
            # the server warms itself before it reports ready); the same burst ends the run.
            first = load(fresh(burst), args.burst_output_len, burst, "greedy")
            print(f"server first burst: {json.dumps(first)}", flush=True)
            for sampling, c in pairs:
                run = load(prompts_for(c), args.output_len, c, sampling)
                print(f"server {sampling} c{c}: {json.dumps(run)}", flush=True)
                metrics.update({f"{_prefix(sampling)}c{c}_{k}": v for k, v in run.items()})
                if llm is not None:
                    metrics.update(_offline_pair(llm, sampling, c, prompts_for(c), args, metrics))
            capacity = metrics[f"c{top}_request_throughput"]
            for percent in POISSON_PERCENTS:
                rate = capacity * percent / 100
                run = load(fresh(args.poisson_prompts), args.output_len, args.poisson_prompts,
                           "greedy", rate)  # fmt: skip
                print(f"server poisson {percent} % ({rate:.1f} req/s): {json.dumps(run)}")
                metrics.update({f"poisson{percent}_{k}": v for k, v in run.items()})
                metrics[f"poisson{percent}_rate_req_s"] = rate
                metrics[f"poisson{percent}_ttft_p99_over_p50"] = (
                    run["ttft_p99_ms"] / run["ttft_p50_ms"]
                )
            later = load(fresh(burst), args.burst_output_len, burst, "greedy")
            print(f"server later burst: {json.dumps(later)}", flush=True)
        for name, run in (("first_burst", first), ("later_burst", later)):
            metrics.update({f"{name}_{k}": run[k] for k in BURST_FIGURES})
        metrics["first_burst_over_later"] = first["duration_s"] / later["duration_s"]
    finally:
        proc.terminate()
        proc.wait(120)
    if llm is None:
        started = time.perf_counter()
        llm = bench_llm(model, **options)
        metrics["offline_startup_s"] = time.perf_counter() - started
        for sampling, c in pairs:
            metrics.update(_offline_pair(llm, sampling, c, prompts_for(c), args, metrics))
    print("offline: " + json.dumps({k: v for k, v in metrics.items() if "offline" in k}))
    suffixed = {}
    for key, value in metrics.items():
        mode = next((m for m in SAMPLINGS[1:] if key.startswith(f"{m}_")), None)
        suffixed[key[len(mode) + 1 :] + f"_{mode}" if mode else key] = value
    return suffixed


def _offline_pair(
    llm, sampling: str, c: int, prompts: list[list[int]], args: argparse.Namespace,
    server: dict[str, float],
) -> dict[str, float]:  # fmt: skip
    """The offline twin of the server run (sampling, c) and their ratios."""
    pre = _prefix(sampling)
    if c == 1:
        tpot_ms = offline_tpot(llm, prompts[:3], args.output_len, sampling) * 1000
        return {f"{pre}offline_tpot_c1_ms": tpot_ms,
                f"{pre}tpot_c1_over_offline": server[f"{pre}c1_tpot_p50_ms"] / tpot_ms}  # fmt: skip
    tok_s = offline_runs(llm, prompts, args.output_len, c, sampling)
    return {
        f"{pre}offline_c{c}_output_tok_s": tok_s,
        f"{pre}server_vs_offline_c{c}": server[f"{pre}c{c}_output_tok_s"] / tok_s,
        f"{pre}ttft_p99_over_p50_c{c}": (
            server[f"{pre}c{c}_ttft_p99_ms"] / server[f"{pre}c{c}_ttft_p50_ms"]
        ),
    }


def _prefix(sampling: str) -> str:
    return "" if sampling == "greedy" else f"{sampling}_"


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
    p.add_argument("--sampling", choices=SAMPLINGS, default="greedy",
                   help="greedy, t1 (temperature 1.0, top_p 1) or mixed (request i takes "
                   "mix i mod 9 of the sampling mixes); --record runs all three")  # fmt: skip
    p.add_argument(
        "--record",
        action="store_true",
        help="launch a server, run --concurrency levels and offline, write --out",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="concurrency levels of --record (1 8 32) or --gpu-record (1 64 256)",
    )
    p.add_argument(
        "--gpu-record",
        action="store_true",
        help="the GPU record: launch the 8B shape (random weights) as a server, a lean "
        "client in its own process, then offline; writes h200_serving.json",
    )
    p.add_argument(
        "--model",
        default=None,
        help="--gpu-record's model: a path or a config of "
        "configs/models/ (default: llama-3.1-8b; on --device cpu the embedded model)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        help="--gpu-record's API processes (default: the server's own default)",
    )
    p.add_argument(
        "--c1-prompts",
        type=int,
        default=8,
        help="requests of the concurrency-1 run of --gpu-record",
    )
    p.add_argument(
        "--poisson-prompts",
        type=int,
        default=512,
        help="requests of each steady-arrival (Poisson) run of --gpu-record",
    )
    p.add_argument(
        "--burst-requests",
        type=int,
        default=None,
        help="requests of --gpu-record's first burst after start-up and of the same "
        "burst at the end, all at once (default: the highest --concurrency)",
    )
    p.add_argument("--burst-output-len", type=int, default=64,
                   help="output tokens per request of those bursts")  # fmt: skip
    p.add_argument(
        "--server-arg",
        action="append",
        help="an extra `loraplex serve` argument for --record (repeatable)",
    )
    p.add_argument("--note", default=None, help="a line the record keeps (e.g. what was "
                   "shrunk to fit a time budget)")  # fmt: skip
    p.add_argument("--out", default=None, help="the record's name in benchmarks/results/ "
                   "(cpu_serving.json for --record, h200_serving.json for --gpu-record)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpu_record:
        return main_gpu_record(args)
    args.concurrency = args.concurrency or [1, 8, 32]
    prompts = serving_prompts(args.num_prompts, args.input_len, args.seed)
    if args.record:
        load = os.getloadavg()
        metrics = record(args, prompts)
        write_result(
            args.out or "cpu_serving.json", "serving", metrics,
            {"offline": "the same workload through the offline API (LLM.generate, one batch); "
             "server_vs_offline_cN = server output tok/s at concurrency N / offline output "
             "tok/s"},
            workload={"num_prompts": args.num_prompts, "input_len": args.input_len,
                      "output_len": args.output_len, "load_avg_at_start": load},
        )  # fmt: skip
        return 0
    if args.offline:
        metrics = run_offline_benchmark(prompts, args.output_len, (args.sampling,))[args.sampling]
    else:
        metrics = asyncio.run(run_server_benchmark(args.base_url, prompts, args.output_len,
                                                   args.max_concurrency, args.request_rate,
                                                   args.seed, args.sampling))  # fmt: skip
    print(json.dumps(metrics, indent=2))
    return 0


def main_gpu_record(args: argparse.Namespace) -> int:
    args.concurrency = args.concurrency or [1, 64, 256]
    load_at_start = os.getloadavg()  # NOTE: a shared CPU host's load bends its figures
    metrics = record_gpu(args)
    write_result(
        args.out or "h200_serving.json",
        "serving (engine-core process, API processes, lean streaming client)",
        metrics,
        {"offline": "the same workload through LLM.generate on the same engine options, in the "
         "same run: server_vs_offline_cN = server output tok/s at concurrency N over offline "
         "tok/s with N requests in flight; tpot_c1_over_offline = the server's median TPOT of "
         "one stream over offline (time of N tokens - time of 1) / (N - 1)",
         "server": "loraplex serve at its default flags but the engine options both sides "
         "share (api_server_count: the count its default chose on this host); startup_s: "
         "from launching it to /health 200 (model, CUDA graphs, warm-up, API processes)",
         "burst": "cN_*: num_prompts requests at concurrency N, all sent at once (c256: the "
         "512-request burst); first_burst_*: burst_requests requests at once, the first load "
         "after start-up; later_burst_*: the same at the end of the server runs; "
         "first_burst_over_later: their durations' ratio",
         "poisson": "poissonP_*: poisson_prompts greedy requests arriving as a Poisson process "
         "at P % of the request rate the server sustained at the highest concurrency (greedy)"},
        workload={"num_prompts": args.num_prompts, "c1_prompts": args.c1_prompts,
                  "input_len": args.input_len, "output_len": args.output_len,
                  "concurrency": args.concurrency, "api_server_count": args.api_server_count,
                  "poisson_prompts": args.poisson_prompts, "poisson_percents": POISSON_PERCENTS,
                  "burst_requests": args.burst_requests or max(args.concurrency),
                  "burst_output_len": args.burst_output_len,
                  "load_avg_at_start": load_at_start, "load_avg_at_end": os.getloadavg(),
                  "note": args.note},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
