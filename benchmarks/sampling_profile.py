"""Where a sampled step's time goes at a full batch: wall time per step, the GPU's busy time,
and the costliest CUDA kernels and host operations, per sampling mix beside greedy.

    python -m benchmarks.sampling_profile [--mixes t1,t07_top_p09,logprobs5,mixed]
        [--tables DIR] [--cprofile]

Runs each mix on the benchmark engine (`benchmarks.common.engine`) with the requests of
`benchmarks.sampling`, a short untimed run first, then `--steps` output tokens under
torch.profiler (`--cprofile`: the host under cProfile, counting the Triton kernels compiled
meanwhile). Prints one summary line per mix, writes the full tables to DIR (default: the working
directory) and the per-step figures to the record (`wall_ms_per_step_<mix>`,
`gpu_busy_ms_per_step_<mix>`; with `--cprofile`, `wall_ms_per_step_cprofile_<mix>` and
`triton_compiles_<mix>`). The profilers inflate host time: compare mixes within a run.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks.common.engine import bench_llm, resolve_model
from benchmarks.common.prompts import mix_params, random_prompts
from benchmarks.common.sampling_mixes import MIXED, MIXES
from benchmarks.common.timing import synchronize
from benchmarks.record import write_result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--mixes", default="t1,t07_top_p09,logprobs5,mixed")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--tables", default=".", help="folder for the profilers' tables")
    parser.add_argument(
        "--out",
        default=None,
        help="the record (default h200_sampling_profile.json, with --cprofile "
        "h200_sampling_cprofile.json)",
    )
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="profile the host with cProfile instead of torch.profiler, and count Triton compiles",
    )
    return parser


def main() -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    parser = build_parser()
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.sampling_profile needs a CUDA GPU; skipped")
        return 0
    mixes = ["greedy"] + [m for m in args.mixes.split(",") if m != "greedy"]
    if unknown := set(mixes) - {*MIXES, MIXED}:
        parser.error(f"unknown mixes {sorted(unknown)}; choose from {[*MIXES, MIXED]}")
    llm = bench_llm(resolve_model(args.model), max_num_batched_tokens=8192)
    vocab = llm.engine.runner.arch.vocab_size
    n = args.num_requests
    prompts = random_prompts(random.Random(0), vocab, [args.input_len] * n)
    out_dir = Path(args.tables)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, float] = {}
    for mix in mixes:
        llm.generate(prompts, mix_params(mix, [4] * n))
        llm.engine.scheduler.kv.reset_prefix_cache()
        for request, params in zip(prompts, mix_params(mix, [args.steps] * n), strict=True):
            llm.engine.add_request(None, request, params)
        engine = llm.engine
        while engine.scheduler.num_waiting:  # prefill outside the profile
            engine.step()
        synchronize()
        if args.cprofile:
            wall_ms, compiles = host_profile(engine, mix, out_dir)
            metrics[f"wall_ms_per_step_cprofile_{mix}"] = round(wall_ms, 2)
            metrics[f"triton_compiles_{mix}"] = compiles
            continue
        steps = 0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            synchronize()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        by_gpu = events.table(sort_by="self_cuda_time_total", row_limit=15)
        by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=15)
        (out_dir / f"profile_{mix}.txt").write_text(by_gpu + "\n\n" + by_cpu)
        top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:4]
        host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:4]
        print(
            f"{mix}: {steps} steps, wall {wall / steps * 1e3:.2f} ms/step, GPU busy "
            f"{gpu_us / steps / 1e3:.2f} ms/step\n  GPU: "
            + "; ".join(f"{e.key[:48]} {e.self_device_time_total / steps / 1e3:.3f}" for e in top)
            + "\n  CPU: "
            + "; ".join(f"{e.key[:48]} {e.self_cpu_time_total / steps / 1e3:.3f}" for e in host)
        )
        metrics[f"wall_ms_per_step_{mix}"] = round(wall / steps * 1e3, 2)
        metrics[f"gpu_busy_ms_per_step_{mix}"] = round(gpu_us / steps / 1e3, 2)
    default = "h200_sampling_cprofile.json" if args.cprofile else "h200_sampling_profile.json"
    write_result(
        args.out or default,
        "sampling_profile",
        metrics,
        {"greedy": "the same engine and requests, temperature 0, profiled the same way"},
        workload={"model": args.model, "num_requests": n, "input_len": args.input_len,
                  "profiled_steps": args.steps},
    )  # fmt: skip
    return 0


def host_profile(engine, mix: str, out_dir: Path) -> tuple[float, int]:
    """The remaining steps under cProfile, counting the Triton kernels compiled (or loaded
    from Triton's disk cache) meanwhile (a steady step should compile none): (wall ms per
    step, kernels compiled)."""
    import cProfile
    import io
    import pstats

    from triton.runtime.jit import JITFunction

    compiled: list[str] = []
    do_compile = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return do_compile(self, *args, **kwargs)

    JITFunction._do_compile = counting
    steps = 0
    prof = cProfile.Profile()
    try:
        start = time.perf_counter()
        prof.enable()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        synchronize()
        prof.disable()
        wall = time.perf_counter() - start
    finally:
        JITFunction._do_compile = do_compile
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    (out_dir / f"cprofile_{mix}.txt").write_text(text.getvalue())
    print(
        f"{mix}: {steps} steps, wall {wall / steps * 1e3:.2f} ms/step under cProfile; "
        f"Triton compiles during them: {len(compiled)} {sorted(set(compiled))}"
    )
    print("\n".join(text.getvalue().splitlines()[:45]))
    return wall / steps * 1e3, len(compiled)


if __name__ == "__main__":
    raise SystemExit(main())
