"""The GPU path on an H200: latency, decode TPOT and bandwidth use, throughput against
HF transformers on the same random Llama-3.1-8B-shaped weights.

    python -m benchmarks.gpu_path [--model configs/models/llama-3.1-8b.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from benchmarks.common.engine import (
    DECODE_PROMPT_LEN,
    DECODE_STEPS,
    LLAMA_8B,
    bench_llm,
    decode_tpot,
)
from benchmarks.common.hf_baseline import hf_generate_static, hf_model_from_engine
from benchmarks.common.prompts import nano_vllm_workload, random_prompts
from benchmarks.common.sampling_mixes import GREEDY, T1
from benchmarks.common.timing import best_seconds_per_call, wall_seconds
from benchmarks.record import RESULTS, write_result
from loraplex import SamplingParams


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write), the ceiling for memory-bound decode."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() / best_seconds_per_call(lambda: dst.copy_(src), repeats=5)


def hf_single_stream(hf, modes: set[str], rng: random.Random, vocab: int) -> dict[str, float]:
    """HF's latency (batch 8, 32 in / 128 out) and decode time per token at batch 1, eager
    and/or with the static KV cache that `generate` compiles (compile time excluded)."""
    out: dict[str, float] = {}
    for mode, kwargs in (("eager", {}), ("compiled", {"cache_implementation": "static"})):
        if mode not in modes:
            continue
        if mode == "compiled":
            # The first call of each shape compiles: the static cache is sized by prompt plus
            # new tokens, so warm up with exactly the shapes timed below.
            for bs, new in ((8, 128), (1, 1), (1, 65)):
                hf_generate_static(hf, random_prompts(rng, vocab, [32] * bs), [new] * bs, **kwargs)
        t, _ = hf_generate_static(hf, random_prompts(rng, vocab, [32] * 8), [128] * 8, **kwargs)
        out[f"hf_{mode}_latency_bs8_32in_128out_s"] = t
        t1, _ = hf_generate_static(hf, random_prompts(rng, vocab, [32]), [1], **kwargs)
        t65, _ = hf_generate_static(hf, random_prompts(rng, vocab, [32]), [65], **kwargs)
        out[f"hf_{mode}_tpot_bs1_ms"] = (t65 - t1) / 64 * 1e3
        print(
            f"HF {mode}: latency {out[f'hf_{mode}_latency_bs8_32in_128out_s']:.2f} s, "
            f"tpot {out[f'hf_{mode}_tpot_bs1_ms']:.1f} ms"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=LLAMA_8B)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--hf-subset", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--hf-modes",
        default="static,eager,compiled",
        help="HF baselines to run: static (padded-batch throughput on the subset), eager "
        "(latency and decode time), compiled (the same with a static KV cache, which "
        "`generate` compiles itself; compile time excluded)",
    )
    parser.add_argument(
        "--skip-throughput",
        action="store_true",
        help="only latency and decode time (a quick re-measure)",
    )
    parser.add_argument("--out", default="h200_gpu_path.json")
    parser.add_argument(
        "--gemv-configs",
        default=None,
        help="a JSON file of one-token GEMV configs (`python -m benchmarks.gemv` writes it) "
        "used instead of loraplex.kernels.gemv.GEMV_CONFIGS",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.gpu_path needs a CUDA GPU; skipped")
        return 0
    if args.gemv_configs:
        from loraplex.kernels import gemv

        with open(args.gemv_configs) as f:
            table = {
                tuple(map(int, key.split(","))): gemv.GemvConfig(*value)
                for key, value in json.load(f).items()
            }
        gemv.GEMV_CONFIGS.clear()
        gemv.GEMV_CONFIGS.update(table)
        print(f"one-token GEMV configs: {table}")

    t0 = time.perf_counter()
    llm = bench_llm(args.model, max_num_batched_tokens=8192)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s; {llm.stats()}")
    runner = llm.engine.runner
    vocab = runner.arch.vocab_size
    rng = random.Random(0)
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}

    # 1. latency: batch 8, 32 in / 128 out, end to end; 2. decode time per token at batch 1.
    # Both with async scheduling (the default on CUDA) and, beside it, in lock step.
    engine = llm.engine
    for mode, overlap in (("lock_step_", False), ("", True)):
        engine.async_scheduling = overlap
        llm.generate(random_prompts(rng, vocab, [32] * 8), SamplingParams(max_tokens=128, **GREEDY))
        runs = [
            wall_seconds(
                lambda: llm.generate(
                    random_prompts(rng, vocab, [32] * 8), SamplingParams(max_tokens=128, **GREEDY)
                )
            )
            for _ in range(3)
        ]
        tpot, replay = decode_tpot(llm, rng)
        into = metrics if overlap else baseline
        into[f"{mode}latency_bs8_32in_128out_s"] = statistics.median(runs)
        into[f"{mode}tpot_bs1_ms"] = tpot * 1e3
        print(f"{mode or 'async '}latency bs8 32/128: {runs}; tpot bs1 {tpot * 1e3:.3f} ms")
    # The same decode time, sampled as the openai SDK samples by default.
    t1_tpot, _ = decode_tpot(llm, rng, T1)
    metrics["t1_tpot_bs1_ms"] = t1_tpot * 1e3
    print(f"t1 tpot bs1 {t1_tpot * 1e3:.3f} ms")
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    a = runner.arch
    avg_ctx = DECODE_PROMPT_LEN + DECODE_STEPS / 2
    kv_bytes = avg_ctx * a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2
    if replay is not None:
        metrics["gpu_decode_step_bs1_ms"] = replay * 1e3
        metrics["cpu_overhead_bs1_ms"] = (tpot - replay) * 1e3
    bw = copy_bandwidth()
    metrics["mbu_bs1"] = (weight_bytes + kv_bytes) / tpot / bw
    metrics["copy_bandwidth_gb_s"] = bw / 1e9
    print(
        f"tpot bs1 {tpot * 1e3:.3f} ms, weights {weight_bytes / 1e9:.2f} GB, "
        f"copy bw {bw / 1e9:.0f} GB/s, mbu {metrics['mbu_bs1']:.3f}"
    )

    if args.skip_throughput:
        modes = set() if args.skip_hf else set(args.hf_modes.split(",")) - {"static"}
        if modes:
            hf = hf_model_from_engine(llm, torch.bfloat16)
            baseline.update(hf_single_stream(hf, modes, rng, vocab))
        write_result(args.out, "gpu_path_decode", metrics, baseline, workload={"model": args.model})
        return 0

    # 3. throughput: nano-vllm's workload
    prompts, params, out_tokens = nano_vllm_workload(vocab, args.num_requests)
    llm.generate(prompts[:8], [SamplingParams(max_tokens=16, **GREEDY)] * 8)
    llm.engine.scheduler.kv.reset_prefix_cache()
    seconds = wall_seconds(lambda: llm.generate(prompts, params))
    metrics["throughput_out_tok_s"] = out_tokens / seconds
    print(f"throughput {args.num_requests} reqs: {out_tokens} tokens in {seconds:.1f} s")
    _, t1_params, _ = nano_vllm_workload(vocab, args.num_requests, T1)
    llm.engine.scheduler.kv.reset_prefix_cache()
    t1_seconds = wall_seconds(lambda: llm.generate(prompts, t1_params))
    metrics["t1_throughput_out_tok_s"] = out_tokens / t1_seconds
    metrics["t1_throughput_ratio_vs_greedy"] = seconds / t1_seconds
    print(f"t1 throughput: {out_tokens} tokens in {t1_seconds:.1f} s")
    sub = args.hf_subset
    llm.engine.scheduler.kv.reset_prefix_cache()
    sub_seconds = wall_seconds(lambda: llm.generate(prompts[:sub], params[:sub]))
    sub_tokens = sum(p.max_tokens for p in params[:sub])
    metrics[f"throughput_subset{sub}_out_tok_s"] = sub_tokens / sub_seconds
    print(f"throughput subset {sub}: {sub_tokens / sub_seconds:.0f} tok/s")

    attention = RESULTS / "h200_attention.json"
    if attention.is_file():
        attn = json.loads(attention.read_text())["metrics"]
        for key in ("attn_prefill_vs_sdpa", "attn_decode_vs_sdpa"):
            if key in attn:
                metrics[key] = attn[key]

    modes = set() if args.skip_hf else set(args.hf_modes.split(","))
    if modes:
        hf = hf_model_from_engine(llm, torch.bfloat16)
    if "static" in modes:
        t, useful = hf_generate_static(hf, prompts[:sub], [p.max_tokens for p in params[:sub]])
        baseline[f"hf_static_subset{sub}_out_tok_s"] = useful / t
        metrics["speedup_vs_hf_static"] = metrics[f"throughput_subset{sub}_out_tok_s"] / (
            useful / t
        )
        print(f"HF static subset {sub}: {useful / t:.0f} tok/s in {t:.1f} s")
    if modes:
        baseline.update(hf_single_stream(hf, modes, rng, vocab))
    print(json.dumps(metrics, indent=2))
    write_result(
        args.out,
        "gpu_path",
        metrics,
        baseline,
        workload={
            "model": args.model,
            "num_requests": args.num_requests,
            "hf_subset": sub,
            "input_output_uniform": [100, 1024],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
