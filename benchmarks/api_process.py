"""One API server process at hundreds of streams, on a CPU host, without a model.

A stand-in engine core (`benchmarks.common.stand_in_core`: the real EngineLoop and ZeroMQ
transport, one token per running sample every --step-ms) serves one or more real API server
processes (`loraplex.entrypoints.api_server`, the real app), and the lean streaming client
(`benchmarks.common.stream_client`, a process of its own) streams --num-requests completions at
--streams concurrent streams. Reported: the API processes' CPU seconds per output token, the
output tokens/s the client received against the stand-in core's rate (streams / step time), and
the stream latencies; with --profile, the top of the API process's profile (py-spy, sampling the
running process; or cProfile, which slows it down: read its shares, not its speed).

    python -m benchmarks.api_process --streams 256 --num-requests 512
    python -m benchmarks.api_process --streams 256 --profile py-spy
    python -m benchmarks.api_process --streams 256 --record   # writes cpu_api_process.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import json
import multiprocessing
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.prompts import serving_prompts
from benchmarks.common.server_launch import free_port
from benchmarks.common.stand_in_core import run_stand_in_core
from benchmarks.common.stream_client import lean_client_run
from benchmarks.record import write_result

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds `pid` has used so far."""
    return sum(cpu_times(pid))


def _profiled_api_server(profile_path: str, *args) -> None:
    """`run_api_server(*args)` under cProfile; the stats go to `profile_path` when it exits."""
    from loraplex.entrypoints.api_server import run_api_server

    # NOTE: uvicorn raises the exit signal again once it has shut down, under the handler it
    # found: this one, so that the profile is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # NOTE: timed by the CPU clock of the thread that runs the event loop (all the Python work
    # of an API process), so a host busy with other work does not inflate the functions that
    # happened to run when the process was descheduled, nor other threads' work (ZeroMQ's I/O
    # thread) theirs.
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        run_api_server(*args)
    finally:
        profiler.disable()
        profiler.dump_stats(profile_path)


def _api_server(*args) -> None:
    from loraplex.entrypoints.api_server import run_api_server

    run_api_server(*args)


class Servers:
    """The stand-in core and `count` API processes on a free loopback port."""

    def __init__(self, model_dir: str, step_s: float, count: int, profile_path: str | None):
        from loraplex.entrypoints.launcher import bind_listener
        from loraplex.platform.api.settings import ServerSettings

        self.context = multiprocessing.get_context("spawn")
        self.folder = tempfile.TemporaryDirectory(prefix="api-process-bench-")
        address = f"ipc://{self.folder.name}/core.sock"
        ready, ready_writer = self.context.Pipe(duplex=False)
        self.core = self.context.Process(
            target=run_stand_in_core, args=(address, model_dir, step_s, ready_writer)
        )
        self.core.start()
        if not ready.poll(120):
            raise RuntimeError("the stand-in core did not start")
        ready.recv()
        port = free_port()
        listener = bind_listener("127.0.0.1", port)
        settings = ServerSettings(port=port, data_dir=self.folder.name)
        args = (settings, listener, address, {"log_level": "warning"}, 5.0, os.getpid())
        self.api = []
        for _ in range(count):
            target, target_args = _api_server, args
            if profile_path is not None:
                target, target_args = _profiled_api_server, (profile_path, *args)
            process = self.context.Process(target=target, args=target_args)
            process.start()
            self.api.append(process)
        listener.close()
        self.base_url = f"http://127.0.0.1:{port}"
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not all(p.is_alive() for p in self.api):
                raise RuntimeError("an API process exited while starting")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.model = httpx.get(f"{self.base_url}/v1/models").json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the API process did not answer /health")

    def api_cpu_seconds(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.api)

    def api_system_seconds(self) -> float:
        return sum(cpu_times(p.pid)[1] for p in self.api)

    def stop(self) -> None:
        for process in [*self.api, self.core]:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(5)
            if process.exitcode != 0:
                print(f"{process.name} exited with {process.exitcode}", file=sys.stderr)
        self.folder.cleanup()


def py_spy_top(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """Start sampling `pid` with py-spy for `seconds` into `out` (collapsed stacks)."""
    py_spy = Path(sys.executable).parent / "py-spy"
    cmd = [str(py_spy), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "100",
           "--format", "raw", "-o", str(out)]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def summarize_collapsed(path: Path, top: int) -> dict[str, list[tuple[str, float]]]:
    """The shares of samples per function: `self` (the sampled frame) and `total` (anywhere on
    the stack), the `top` of each."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = [_short(f) for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    share = lambda c: [(name, round(n / samples, 4)) for name, n in c.most_common(top)]  # noqa: E731
    return {"self": share(own), "total": share(total), "samples": samples}  # type: ignore[dict-item]


def _short(frame: str) -> str:
    """`func (path/to/module.py:12)` -> `func (module.py)`."""
    name, _, where = frame.partition(" (")
    file = where.split(":")[0].rstrip(")")
    return f"{name} ({'/'.join(Path(file).parts[-2:])})"


def cprofile_top(path: str, top: int) -> str:
    stream = io.StringIO()
    stats = pstats.Stats(path, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return stream.getvalue()


async def _admit_all(base_url: str, model: str, prompts: list[list[int]], concurrency: int) -> None:
    """Every prompt as a one-token, non-streamed completion, `concurrency` at a time: the API
    process's work per request (body, validation, tokenizer, admission, engine round trip)."""
    import aiohttp

    limit = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
        async with limit, session.post(f"{base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            await response.read()

    connector = aiohttp.TCPConnector(limit=concurrency + 8)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(one(session, p) for p in prompts))


def run(args: argparse.Namespace) -> dict:
    from loraplex.platform.models.model_store import ensure_default_model

    model_dir = args.model or str(ensure_default_model(progress=False))
    step_s = args.step_ms / 1000
    profile_path = None
    if args.profile == "cprofile":
        profile_path = str(Path(tempfile.mkdtemp()) / "api.prof")
    servers = Servers(model_dir, step_s, args.api_server_count, profile_path)
    prompts = serving_prompts(args.num_requests, args.input_len, args.seed)
    spy = None
    try:
        # The work per request, apart: the same prompts, one token each.
        admit_prompts = serving_prompts(args.num_requests, args.input_len, args.seed + 1)
        before = servers.api_cpu_seconds()
        asyncio.run(_admit_all(servers.base_url, servers.model, admit_prompts, args.streams))
        admit_cpu = servers.api_cpu_seconds() - before
        cpu_before = servers.api_cpu_seconds()
        system_before = servers.api_system_seconds()
        core_before = cpu_seconds(servers.core.pid)
        wall_before = time.perf_counter()
        if args.profile == "py-spy":
            # NOTE: past the client's start-up and warm-up request, over the steady part.
            expected_s = args.num_requests * args.output_len * step_s / args.streams
            spy_out = Path(tempfile.mkdtemp()) / "api.txt"
            spy = py_spy_top(servers.api[0].pid, max(2.0, expected_s * 0.6), spy_out)
        load = lean_client_run(servers.base_url, servers.model, prompts, args.output_len,
                               args.streams, args.sampling)  # fmt: skip
        wall = time.perf_counter() - wall_before
        cpu = servers.api_cpu_seconds() - cpu_before
        system = servers.api_system_seconds() - system_before
        core_cpu = cpu_seconds(servers.core.pid) - core_before
    finally:
        servers.stop()
    tokens = args.num_requests * args.output_len
    core_rate = args.streams / step_s
    result = {
        "api_server_count": args.api_server_count,
        "api_cpu_s": cpu,
        "api_cpu_us_per_token": cpu / tokens * 1e6,
        "api_cpu_ms_per_request": admit_cpu / args.num_requests * 1e3,
        # what streaming costs per token, the requests' own work apart
        "api_stream_cpu_us_per_token": (cpu - admit_cpu) / tokens * 1e6,
        "api_system_share_of_cpu": system / cpu,  # the kernel's: sockets, wake-ups
        "api_cpu_share_of_wall": cpu / wall,
        "core_cpu_s": core_cpu,
        "client_cpu_s": load["client_cpu_s"],
        "wall_s": wall,
        "output_tok_s": load["output_tok_s"],
        "core_tok_s": core_rate,
        "output_tok_s_over_core": load["output_tok_s"] / core_rate,
        **{k: v for k, v in load.items() if k.endswith("_ms")},
    }
    if spy is not None:
        _, err = spy.communicate(timeout=300)
        if spy.returncode != 0:
            raise RuntimeError(f"py-spy failed: {err.decode(errors='replace')}")
        result["profile"] = summarize_collapsed(spy_out, args.top)
    if profile_path is not None:
        result["profile_text"] = cprofile_top(profile_path, args.top)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=256, help="concurrent streams")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=10.0, help="the stand-in core's step time")
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("--sampling", default="greedy", help="the client's sampling mix (fields only: "
                   "the stand-in core ignores them)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a model folder for the tokenizer (default: "
                   "the embedded SmolLM2)")  # fmt: skip
    p.add_argument("--profile", choices=("py-spy", "cprofile"), default=None)
    p.add_argument("--top", type=int, default=25, help="functions shown of the profile")
    p.add_argument("--record", action="store_true", help="write benchmarks/results/--out")
    p.add_argument("--out", default="cpu_api_process.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = result.pop("profile_text", None)
    print(json.dumps(result, indent=2))
    if text:
        print(text)
    if args.record:
        write_result(
            args.out, "API process at N streams (stand-in engine core, real API server)",
            {k: v for k, v in result.items() if k != "profile"},
            {"core_tok_s": "what the stand-in core emits with every stream running: streams / "
             "step time"},
            workload={"streams": args.streams, "num_requests": args.num_requests,
                      "input_len": args.input_len, "output_len": args.output_len,
                      "step_ms": args.step_ms, "load_avg": os.getloadavg()},
            profile=result.get("profile"),
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
