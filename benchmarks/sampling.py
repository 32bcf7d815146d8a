"""Sampled decoding: output tokens/s of a full batch and decode time per token at batch 1, for
each sampling mix beside greedy, on one engine.

    python -m benchmarks.sampling [--model configs/models/llama-3.1-8b.json] [--mixes t1,rep11]
    python -m benchmarks.sampling --model qwen3-0.6b          # a config in configs/models/
    python -m benchmarks.sampling --device cpu                # small run, embedded model

Workload (GPU defaults): random bf16 weights of the model's shape, 256 requests of 128 random
prompt tokens, 256 output tokens each, ignore_eos, all at once; TPOT as every GPU benchmark
measures it (`benchmarks.common.engine.decode_tpot`: batch 1, 32 prompt tokens, (257 tokens -
1) / 256, median of 3). Every mix runs on the same engine, after an untimed short run of its own
(kernels compile there), from an empty prefix cache; `--rounds` repeats the pass over the mixes
and keeps each one's best. Mixes without a temperature of their own sample at 1.0, the openai
SDK's default. Records `greedy_out_tok_s`, `tpot_bs1_greedy_ms`, and per mix `<mix>_out_tok_s`,
`ratio_<mix>_vs_greedy` (its tok/s over greedy's) and `tpot_bs1_<mix>_ms`.
"""

from __future__ import annotations

import argparse
import json
import random

from benchmarks.common.engine import bench_llm, decode_tpot, resolve_model
from benchmarks.common.prompts import mix_params, random_prompts
from benchmarks.common.sampling_mixes import MIXED, MIXES
from benchmarks.common.timing import wall_seconds
from benchmarks.record import write_result
from loraplex import LLM


def throughput(llm: LLM, prompts: list[list[int]], mix: str, output_len: int) -> float:
    """Output tokens/s of the whole batch under one mix, after an untimed short run of it."""
    llm.generate(prompts, mix_params(mix, [4] * len(prompts)))
    params = mix_params(mix, [output_len] * len(prompts))
    llm.engine.scheduler.kv.reset_prefix_cache()
    seconds = wall_seconds(lambda: llm.generate(prompts, params))
    return len(prompts) * output_len / seconds


def measure(
    llm: LLM, prompts: list[list[int]], mixes: list[str], output_len: int, steps: int, rounds: int
) -> dict[str, float]:
    """Per mix: the best tok/s and the lowest TPOT over `rounds` rounds, each round running
    every mix in turn (on a shared CPU, interleaving spreads load changes over the mixes)."""
    metrics: dict[str, float] = {}
    for _ in range(rounds):
        for mix in mixes:
            tok_s = throughput(llm, prompts, mix, output_len)
            metrics[f"{mix}_out_tok_s"] = max(tok_s, metrics.get(f"{mix}_out_tok_s", 0.0))
            if mix == MIXED:
                print(f"{mix}: {tok_s:.1f} tok/s")
                continue
            tpot = tpot_ms(llm, mix, steps)
            key = f"tpot_bs1_{mix}_ms"
            metrics[key] = min(tpot, metrics.get(key, float("inf")))
            print(f"{mix}: {tok_s:.1f} tok/s, tpot bs1 {tpot:.3f} ms")
    for mix in mixes[1:]:
        metrics[f"ratio_{mix}_vs_greedy"] = (
            metrics[f"{mix}_out_tok_s"] / metrics["greedy_out_tok_s"]
        )
    return metrics


def tpot_ms(llm: LLM, mix: str, steps: int) -> float:
    fields = dict(MIXES[mix])
    if fields.pop("seed", False):
        fields["seed"] = 0
    tpot, _ = decode_tpot(llm, random.Random(0), dict(ignore_eos=True, **fields), steps)
    return tpot * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a model path or a configs/models name (default: "
        "llama-3.1-8b on cuda, the embedded model on cpu)",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--mixes",
        default=None,
        help=f"comma-separated subset of {','.join([*MIXES, MIXED])} (greedy always runs: the "
        "ratios need it; default: all on cuda, t1 and mixed on cpu)",
    )
    parser.add_argument("--num-requests", type=int, default=None, help="256 (cuda), 8 (cpu)")
    parser.add_argument("--input-len", type=int, default=None, help="128 (cuda), 16 (cpu)")
    parser.add_argument("--output-len", type=int, default=None, help="256 (cuda), 16 (cpu)")
    parser.add_argument("--tpot-steps", type=int, default=None, help="256 (cuda), 16 (cpu)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds over the mixes, best kept: 1 (cuda), 3 (cpu)",
    )
    parser.add_argument("--out", default=None, help="h200_sampling.json / cpu_sampling.json")
    args = parser.parse_args()
    cpu = args.device == "cpu"
    mixes = (args.mixes or (f"t1,{MIXED}" if cpu else ",".join([*MIXES, MIXED]))).split(",")
    if unknown := set(mixes) - {*MIXES, MIXED}:
        parser.error(f"unknown mixes {sorted(unknown)}; choose from {[*MIXES, MIXED]}")
    mixes = ["greedy"] + [m for m in mixes if m != "greedy"]
    n = args.num_requests or (8 if cpu else 256)
    input_len = args.input_len or (16 if cpu else 128)
    output_len = args.output_len or (16 if cpu else 256)
    steps = args.tpot_steps or (16 if cpu else 256)
    if cpu:
        model = resolve_model(args.model)
        blocks = (n + 1) * (-(-(input_len + output_len) // 16) + 2) + 32
        llm = LLM(model, device="cpu", dtype="float32", enable_lora=False, seed=0,
                  max_model_len=1024, num_kv_blocks=blocks)  # fmt: skip
    else:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks.sampling needs a CUDA GPU (or --device cpu); skipped")
            return 0
        model = resolve_model(args.model or "llama-3.1-8b")
        llm = bench_llm(model, max_num_batched_tokens=8192)
    vocab = llm.engine.runner.arch.vocab_size
    prompts = random_prompts(random.Random(0), vocab, [input_len] * n)
    rounds = args.rounds or (3 if cpu else 1)
    metrics = measure(llm, prompts, mixes, output_len, steps, rounds)
    print(json.dumps(metrics, indent=2))
    write_result(
        args.out or ("cpu_sampling.json" if cpu else "h200_sampling.json"),
        "sampling",
        metrics,
        {"greedy": "the same engine and requests, temperature 0"},
        workload={
            "model": model or "embedded SmolLM2-135M-Instruct (fp32)",
            "num_requests": n,
            "input_len": input_len,
            "output_len": output_len,
            "tpot": f"batch 1, ({steps + 1} tokens - 1) / {steps}, median of 3",
            "rounds": f"{rounds} over the mixes in turn; best tok/s and lowest TPOT kept",
            "mixes": {m: MIXES.get(m, f"request i takes mix i mod {len(MIXES)}") for m in mixes},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
