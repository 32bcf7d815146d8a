"""Quantized bases end to end on an H200 against bf16, on random Llama-3.1-8B-shaped weights.

    python -m benchmarks.quant_e2e [--models bf16,awq,gptq,fp8] [--num-requests 256]
        [--awq-dtype auto]

For each model in turn, one engine at a time: bf16; AWQ 4-bit g128
(configs/models/llama-3.1-8b-awq.json); GPTQ 4-bit g128 with act-order
(configs/models/llama-3.1-8b-gptq.json); FP8 quantized at load:
- decode time per output token at batch 1, measured as in `benchmarks.gpu_path`:
  (time of 257 tokens - time of 1 token) / 256, median of 3, 32 input tokens, greedy, ignore_eos;
  plus the GPU time of one batch-1 decode step (CUDA-graph replay);
- throughput on `benchmarks.gpu_path`'s nano-vllm workload (input and output lengths uniform in
  [100, 1024]), `--num-requests` of them (256: as many sequences running at once). The workload
  runs once untimed first, so Triton compiles every kernel specialization the timed run meets.
Both greedy and `t1` (temperature 1.0, top_p 1: the openai SDK's default); throughput also under
the `mixed` sampling batch of `benchmarks.common.sampling_mixes` (request i takes the (i mod 9)-th mix).
Ratios to bf16 are `<model>_tpot_ratio` and `<model>_throughput_ratio`, with `_t1` and (for
throughput) `_mixed` twins.
With LORAPLEX_QUANT_GEMM_TABLE set (a table `benchmarks.quant_gemm --table` wrote), the W4A16
layers dispatch from that table; the record keeps its path and entries.
The AWQ weights are random in AutoAWQ's checkpoint format and go through the same load-time
repack as a real checkpoint. Prints which W4A16 kernel each layer shape runs per token count.
Writes benchmarks/results/h200_quant_e2e.json (the bf16 model always runs: the ratios need it).
Skips (exit 0) without CUDA.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.common.engine import DECODE_PROMPT_LEN, DECODE_STEPS, bench_llm, decode_tpot
from benchmarks.common.prompts import nano_vllm_workload
from benchmarks.common.sampling_mixes import GREEDY, MIXED, T1, mix_fields
from benchmarks.common.timing import wall_seconds as cuda_timed
from benchmarks.record import write_result
from loraplex import LLM, SamplingParams, envs
from loraplex.platform.models.linear import Linear

#: Token counts whose W4A16 kernel choice is printed: decode at batch 1..64, prefill chunks.
KERNEL_REPORT_M = (1, 16, 64, 256, 1024, 8192)

#: The engines one run can measure (--models), bf16 first: the others are divided by it.
MODELS = ("bf16", "awq", "gptq", "fp8")


@dataclass(frozen=True)
class ModelSpec:
    """One engine to measure: a random-weight config file, its dtype, a load-time method."""

    name: str
    config: str
    dtype: str
    quantization: str | None = None


@dataclass(frozen=True)
class ModelFigures:
    tpot_bs1_ms: float
    gpu_decode_step_bs1_ms: float | None
    throughput_out_tok_s: float | None
    t1_tpot_bs1_ms: float
    t1_throughput_out_tok_s: float | None
    mixed_throughput_out_tok_s: float | None
    weight_gb: float
    engine_start_s: float


def kernel_choices(llm: LLM) -> dict[str, dict[int, str]]:
    """W4A16 kernel per linear shape ("N x K") and token count, as `w4a16_gemm` picks it."""
    from loraplex.kernels.w4a16 import kernel_name
    from loraplex.quant.wna16 import WNA16LinearMethod

    choices: dict[str, dict[int, str]] = {}
    for module in llm.engine.runner.model.modules():
        if not isinstance(module, Linear) or not isinstance(module.method, WNA16LinearMethod):
            continue
        method, n, k = module.method, module.output_size, module.input_size
        choices.setdefault(
            f"{n}x{k}",
            {m: kernel_name(m, n, k, method.group_size, method.bits) for m in KERNEL_REPORT_M},
        )
    return choices


def throughput(
    llm: LLM, num_requests: int, sampling: dict | str = GREEDY, warm: bool = True
) -> float:
    """Output tokens per second over gpu_path's workload under `sampling` (fields, or MIXED);
    a full untimed run warms up first (unless `warm` is False)."""
    fields = GREEDY if sampling == MIXED else sampling
    prompts, params, out_tokens = nano_vllm_workload(
        llm.engine.runner.arch.vocab_size, num_requests, fields
    )
    if sampling == MIXED:
        params = [
            SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, **mix_fields(MIXED, i))
            for i, p in enumerate(params)
        ]
    if warm:
        llm.generate(prompts, params)
    llm.engine.scheduler.kv.reset_prefix_cache()
    seconds = cuda_timed(lambda: llm.generate(prompts, params))
    print(f"  throughput {num_requests} reqs: {out_tokens} tokens in {seconds:.1f} s")
    return out_tokens / seconds


def measure(spec: ModelSpec, num_requests: int, skip_throughput: bool) -> ModelFigures:
    """Start one engine for `spec`, measure it, and free all its GPU memory."""
    print(f"== {spec.name}: {spec.config} ({spec.dtype}, quantization={spec.quantization})")
    start = time.perf_counter()
    llm = bench_llm(
        spec.config, dtype=spec.dtype, quantization=spec.quantization,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.45,
    )  # fmt: skip
    engine_start = time.perf_counter() - start
    model = llm.engine.runner.model
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"  engine ready in {engine_start:.1f} s, weights {weight_gb:.2f} GB; {llm.stats()}")
    for shape, by_m in kernel_choices(llm).items():
        print(f"  W4A16 {shape}: " + ", ".join(f"M={m} {name}" for m, name in by_m.items()))
    tpot, replay = decode_tpot(llm, random.Random(0))
    step = f", GPU step {replay * 1e3:.3f} ms" if replay is not None else ""
    print(f"  tpot bs1 {tpot * 1e3:.3f} ms{step}")
    t1_tpot, _ = decode_tpot(llm, random.Random(0), T1)
    print(f"  t1 tpot bs1 {t1_tpot * 1e3:.3f} ms")
    tok_s = None if skip_throughput else throughput(llm, num_requests)
    t1_tok_s = None if skip_throughput else throughput(llm, num_requests, T1, warm=False)
    mixed_tok_s = None if skip_throughput else throughput(llm, num_requests, MIXED, warm=False)
    llm.engine.shutdown()
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()
    print(f"  freed: {torch.cuda.memory_allocated() / 1e9:.2f} GB still allocated")
    return ModelFigures(
        tpot_bs1_ms=tpot * 1e3,
        gpu_decode_step_bs1_ms=replay * 1e3 if replay is not None else None,
        throughput_out_tok_s=tok_s,
        t1_tpot_bs1_ms=t1_tpot * 1e3,
        t1_throughput_out_tok_s=t1_tok_s,
        mixed_throughput_out_tok_s=mixed_tok_s,
        weight_gb=weight_gb,
        engine_start_s=engine_start,
    )


def metrics_vs_bf16(figures: dict[str, ModelFigures]) -> dict[str, float]:
    """Each model's figures under its name, and quantized-over-bf16 ratios."""
    bf16 = figures["bf16"]
    metrics: dict[str, float] = {}
    for name, fig in figures.items():
        metrics[f"{name}_tpot_bs1_ms"] = fig.tpot_bs1_ms
        if fig.gpu_decode_step_bs1_ms is not None:
            metrics[f"{name}_gpu_decode_step_bs1_ms"] = fig.gpu_decode_step_bs1_ms
        if fig.throughput_out_tok_s is not None:
            metrics[f"{name}_throughput_out_tok_s"] = fig.throughput_out_tok_s
        metrics[f"{name}_t1_tpot_bs1_ms"] = fig.t1_tpot_bs1_ms
        if fig.t1_throughput_out_tok_s is not None:
            metrics[f"{name}_t1_throughput_out_tok_s"] = fig.t1_throughput_out_tok_s
        if fig.mixed_throughput_out_tok_s is not None:
            metrics[f"{name}_mixed_throughput_out_tok_s"] = fig.mixed_throughput_out_tok_s
        metrics[f"{name}_weight_gb"] = fig.weight_gb
        if name == "bf16":
            continue
        metrics[f"{name}_tpot_ratio"] = fig.tpot_bs1_ms / bf16.tpot_bs1_ms
        metrics[f"{name}_tpot_ratio_t1"] = fig.t1_tpot_bs1_ms / bf16.t1_tpot_bs1_ms
        if fig.gpu_decode_step_bs1_ms is not None and bf16.gpu_decode_step_bs1_ms is not None:
            metrics[f"{name}_gpu_decode_step_ratio"] = (
                fig.gpu_decode_step_bs1_ms / bf16.gpu_decode_step_bs1_ms
            )
        for prefix, suffix in (("", ""), ("t1_", "_t1"), ("mixed_", "_mixed")):
            ours = getattr(fig, f"{prefix}throughput_out_tok_s")
            base = getattr(bf16, f"{prefix}throughput_out_tok_s")
            if ours is not None and base is not None:
                metrics[f"{name}_throughput_ratio{suffix}"] = ours / base
    return metrics


def _table_record() -> dict | None:
    """The W4A16 selection table file in use (path and entries), or None: the built-in one."""
    path = envs.quant_gemm_table()
    if path is None:
        return None
    return {"path": str(path), **json.loads(path.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated, of " + ",".join(MODELS)
    )
    parser.add_argument("--bf16-model", default="configs/models/llama-3.1-8b.json")
    parser.add_argument("--awq-model", default="configs/models/llama-3.1-8b-awq.json")
    parser.add_argument("--gptq-model", default="configs/models/llama-3.1-8b-gptq.json")
    parser.add_argument(
        "--awq-dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16"),
        help="activation dtype of the AWQ and GPTQ engines (auto: the config's, float16 as "
        "AutoAWQ and AutoGPTQ run)",
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--skip-throughput", action="store_true", help="only decode time")
    parser.add_argument("--out", default="h200_quant_e2e.json")
    args = parser.parse_args()
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    names = ["bf16", *(m for m in args.models.split(",") if m != "bf16")]
    if unknown := [m for m in names if m not in MODELS]:
        parser.error(f"unknown --models {unknown}; choose from {list(MODELS)}")
    if not torch.cuda.is_available():
        print("benchmarks.quant_e2e needs a CUDA GPU; skipped")
        return 0
    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")

    all_specs = {
        "bf16": ModelSpec("bf16", args.bf16_model, "bfloat16"),
        "awq": ModelSpec("awq", args.awq_model, args.awq_dtype),
        "gptq": ModelSpec("gptq", args.gptq_model, args.awq_dtype),
        "fp8": ModelSpec("fp8", args.bf16_model, "bfloat16", quantization="fp8"),
    }
    specs = [all_specs[name] for name in names]
    figures = {spec.name: measure(spec, args.num_requests, args.skip_throughput) for spec in specs}
    metrics = metrics_vs_bf16(figures)
    print(json.dumps(metrics, indent=2))
    write_result(
        args.out,
        "quant_e2e",
        metrics,
        {},
        workload={
            "models": [asdict(spec) for spec in specs],
            "engine_start_s": {name: fig.engine_start_s for name, fig in figures.items()},
            "num_requests": None if args.skip_throughput else args.num_requests,
            "input_output_uniform": [100, 1024],
            "tpot": f"({DECODE_STEPS + 1} tokens - 1 token) / {DECODE_STEPS}, median of 3, "
            f"{DECODE_PROMPT_LEN} input tokens, batch 1",
            "targets": {"awq_tpot_ratio": 0.5, "awq_throughput_ratio": 1.15},
            "w4a16_selection_table": _table_record(),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
