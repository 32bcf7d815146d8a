"""Where one CPU decode step of the embedded model goes, at batch 1, 8 and 32.

The offline engine runs `--batch` requests of `--input-len` random tokens; once every one is
decoding, `--steps` engine steps are timed with a wall clock and a process CPU clock around
each stage: the linears (projections and lm_head), attention over the paged cache, rotary and
the KV write, the norms, the activation, the embedding and glue inside the forward pass (what
is left of it), sampling, batch building, scheduling, output processing (detokenization) and
whatever else the step does. `--http` adds the server: the same batch streamed through
`loraplex serve` and its TPOT p50 beside the offline step, the difference being what HTTP, the
API process and the engine-core messages add per token. Greedy, temperature 1.0 and half of
each in one batch (`greedy_t1`) run.

    python -m benchmarks.cpu_step_profile --http
    # writes benchmarks/results/cpu_step_profile.json

Compare stages within one run: the machine's other load moves every wall figure, so the
record keeps the load average beside each batch and the CPU time (which load moves less).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.common.sampling_mixes import GREEDY_T1, mix_fields
from benchmarks.record import write_result

SAMPLINGS = ("greedy", "t1", GREEDY_T1)


class StageClock:
    """Wall and process-CPU seconds per named stage; a stage entered inside another one is
    counted in both (the report subtracts leaves from their parent)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.enabled = False

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu
            self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Time every call of `owner.attr` (a module function or a class's method) as `name`."""
        inner: Callable = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.stage(name):
                return inner(*args, **kwargs)

        setattr(owner, attr, timed)


def instrument(clock: StageClock) -> None:
    """Wrap the stages of a step where the model and engine look them up."""
    from loraplex.platform.engine.engine import Engine
    from loraplex.platform.engine.output_processor import OutputProcessor
    from loraplex.platform.models import llama
    from loraplex.platform.models.linear import Linear
    from loraplex.platform.runner.model_runner import ModelRunner
    from loraplex.platform.scheduler.scheduler import Scheduler

    clock.wrap(Engine, "step", "step")
    clock.wrap(Scheduler, "schedule", "schedule")
    clock.wrap(Scheduler, "update_from_output", "scheduler_update")
    clock.wrap(ModelRunner, "_update_states", "batch_update")
    clock.wrap(ModelRunner, "prepare", "batch_build")
    clock.wrap(ModelRunner, "_forward", "forward")
    clock.wrap(ModelRunner, "sample", "sample")
    clock.wrap(OutputProcessor, "process", "output_processing")
    clock.wrap(Linear, "forward", "linears")
    clock.wrap(llama.LlamaForCausalLM, "compute_logits", "lm_head")
    clock.wrap(llama.RMSNorm, "forward", "norms")
    for fn, name in (("paged_attention", "attention"), ("rotary_write_kv", "rotary_kv_write"),
                     ("silu_and_mul", "activation")):  # fmt: skip
        clock.wrap(llama, fn, name)


def step_breakdown(clock: StageClock, steps: int, which: dict[str, float]) -> dict[str, float]:
    """Milliseconds per step of each stage, leaves separated from their parents."""
    t = {k: v / steps * 1000 for k, v in which.items()}
    forward_leaves = ("linears", "lm_head", "norms", "attention", "rotary_kv_write", "activation")
    out = {k: t.get(k, 0.0) for k in forward_leaves}
    out["forward_glue"] = t.get("forward", 0.0) - sum(out.values())
    engine_parts = ("schedule", "scheduler_update", "batch_update", "batch_build", "sample",
                    "output_processing")  # fmt: skip
    for k in engine_parts:
        out[k] = t.get(k, 0.0)
    out["engine_glue"] = (
        t.get("step", 0.0) - t.get("forward", 0.0) - sum(t.get(k, 0.0) for k in engine_parts)
    )
    out["step"] = t.get("step", 0.0)
    return out


def profile_batch(llm, clock: StageClock, batch: int, args: argparse.Namespace,
                  sampling: str) -> dict[str, Any]:  # fmt: skip
    from loraplex import SamplingParams

    engine = llm.engine
    rng = random.Random(args.seed + batch)
    for i in range(batch):
        params = SamplingParams(max_tokens=args.warmup + args.steps + 4, ignore_eos=True,
                                seed=args.seed, **mix_fields(sampling, i))  # fmt: skip
        prompt = [rng.randrange(1000, 40000) for _ in range(args.input_len)]
        engine.add_request(f"b{batch}-{sampling}-{i}", prompt, params)
    for _ in range(args.warmup):  # prefill and the first decode steps
        engine.step()
    clock.reset()
    clock.enabled = True
    load = os.getloadavg()[0]
    for _ in range(args.steps):
        engine.step()
    clock.enabled = False
    while engine.has_unfinished_requests():
        engine.step()
    wall = step_breakdown(clock, args.steps, clock.wall)
    cpu = step_breakdown(clock, args.steps, clock.cpu)
    return {"load_avg_1m": load, "wall_ms": wall, "cpu_ms": cpu,
            "tok_s": batch / wall["step"] * 1000}  # fmt: skip


def http_tpot(batch: int, args: argparse.Namespace, sampling: str, base_url: str) -> float:
    """TPOT p50 (ms) of `batch` concurrent streams through the server, each of --steps tokens."""
    from benchmarks.common.prompts import serving_prompts
    from benchmarks.common.stream_client import lean_client_run

    prompts = serving_prompts(batch, args.input_len, args.seed)
    run = lean_client_run(base_url, args.model_name, prompts, args.steps, batch, sampling)
    return run["tpot_p50_ms"]


def cases(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(sampling, batch) pairs to run; no greedy_t1 at batch 1 (its one request is greedy)."""
    return [(name, batch) for name in args.samplings for batch in args.batch
            if not (name == GREEDY_T1 and batch == 1)]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--samplings", nargs="+", default=list(SAMPLINGS), choices=SAMPLINGS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--http", action="store_true", help="also time the same batches through the server"
    )
    p.add_argument("--out", default="cpu_step_profile.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from loraplex import LLM

    options = dict(device="cpu", dtype=args.dtype, max_model_len=512, enable_lora=False,
                   max_num_seqs=max(args.batch), seed=args.seed)  # fmt: skip
    llm = LLM(**options)
    clock = StageClock()
    instrument(clock)
    metrics: dict[str, Any] = {"threads": torch.get_num_threads()}
    for name, batch in cases(args):
        run = profile_batch(llm, clock, batch, args, name)
        metrics[f"{name}_b{batch}"] = run
        parts = ", ".join(f"{k} {v:.1f}" for k, v in run["wall_ms"].items())
        print(f"{name} batch {batch}: {run['tok_s']:.1f} tok/s; ms/step: {parts}", flush=True)
    llm.engine.shutdown()
    del llm
    if args.http:
        from benchmarks.common.server_launch import launch_server, serve_flags

        proc, base_url = launch_server(serve_flags(options))
        try:
            import httpx

            args.model_name = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
            for name, batch in cases(args):
                tpot = http_tpot(batch, args, name, base_url)
                run = metrics[f"{name}_b{batch}"]
                run["http_tpot_p50_ms"] = tpot
                run["http_load_avg_1m"] = os.getloadavg()[0]
                run["http_over_offline_step"] = tpot / run["wall_ms"]["step"]
                print(f"{name} batch {batch}: server TPOT p50 {tpot:.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    write_result(args.out, "cpu_step_profile", metrics, {"note": "stages of one engine step"},
                 workload={"input_len": args.input_len, "steps": args.steps, "dtype": args.dtype,
                           "load_avg_at_end": list(os.getloadavg())})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
