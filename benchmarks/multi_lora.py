"""Multi-LoRA serving on an H200 (issue 4): output tokens/s with 1, 8, 64 and 256 distinct
rank-16 adapters in one continuous batch, against base-only serving of the same requests, and
against HF PEFT serving the 64-adapter mix in batches grouped by adapter.

    python -m benchmarks.multi_lora [--model configs/models/llama-3.1-8b.json]

Workload: 512 requests, input and output lengths uniform in [256, 1024] and [128, 512],
ignore_eos, greedy and again `t1` (temperature 1.0, top_p 1: the openai SDK's default; its
metrics carry a `t1_` prefix); request i runs adapter i mod k (k adapters spread uniformly). The adapters are
random, rank 16 on all seven projections, written as PEFT folders and registered through
`LoRARequest` like a user's. Each configuration starts with an empty prefix cache, after a
warm-up request per adapter so that its GPU slot is loaded (loads are measured separately, by
the upload benchmark).

Stages (`--stages`):
- `disabled`: an engine with LoRA disabled serves the requests: the base-only baseline;
- `lora`: one LoRA-enabled engine serves them on the base model alone, then with k adapters;
- `peft`: HF transformers + PEFT on the same weights, the 64-adapter mix in static padded
  batches, one per adapter. HF's eager decode is launch-bound (~0.1 s a step), so it runs
  `--peft-groups` of the 64 groups and its tokens/s over them stands for all 64 (each group is
  one batch of 8 requests drawn the same way); loraplex's is that of all 512 requests.
The record is rewritten after each stage, so a run cut short keeps what it measured; a run of
later stages alone reads the earlier figures from the existing record.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_path import GREEDY, T1, bench_llm, cuda_timed
from benchmarks.hf_baseline import hf_generate_static, hf_model_from_engine
from benchmarks.random_adapter import write_random_adapter
from benchmarks.record import RESULTS, write_result
from loraplex import LLM, LoRARequest, SamplingParams

STAGES = ("disabled", "lora", "peft")


def workload(vocab: int, n: int, seed: int = 2) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lens = [(rng.randint(256, 1024), rng.randint(128, 512)) for _ in range(n)]
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(i)] for i, _ in lens]
    return prompts, [o for _, o in lens]


def engine(model: str, enable_lora: bool, max_loras: int) -> LLM:
    start = time.perf_counter()
    llm = bench_llm(
        model,
        enable_lora=enable_lora,
        max_loras=max_loras,
        max_cpu_loras=max_loras,
        max_lora_rank=16,
        max_model_len=2048,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.75,
    )
    print(f"engine (lora={enable_lora}) ready in {time.perf_counter() - start:.1f} s")
    return llm


SAMPLINGS = {"": GREEDY, "t1_": T1}  # metric prefix -> SamplingParams fields


def serve(llm: LLM, prompts, outputs, loras=None, sampling: dict = GREEDY) -> float:
    """Output tokens/s of one `generate` over all requests, from an empty prefix cache."""
    params = [SamplingParams(max_tokens=o, **sampling) for o in outputs]
    llm.engine.scheduler.kv.reset_prefix_cache()
    seconds = cuda_timed(lambda: llm.generate(prompts, params, lora_request=loras))
    return sum(outputs) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/models/llama-3.1-8b.json")
    parser.add_argument("--num-requests", type=int, default=512)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--peft-groups", type=int, default=2)
    parser.add_argument("--adapter-dir", default=None, help="where to write the adapters")
    parser.add_argument("--out", default="h200_multi_lora.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.multi_lora needs a CUDA GPU; skipped")
        return 0
    stages = args.stages.split(",")
    if unknown := set(stages) - set(STAGES):
        parser.error(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    previous = RESULTS / args.out
    old = json.loads(previous.read_text()) if previous.is_file() else {}
    metrics: dict[str, float] = dict(old.get("metrics", {}))
    baseline: dict[str, float] = dict(old.get("baseline", {}))
    folder = Path(args.adapter_dir or tempfile.mkdtemp(prefix="loraplex-multi-lora-"))
    n = args.num_requests

    def record() -> None:
        for prefix in SAMPLINGS:
            base = baseline.get(f"{prefix}base_lora_disabled_out_tok_s")
            for k in args.adapters:
                if base and f"{prefix}lora_{k}_out_tok_s" in metrics:
                    metrics[f"{prefix}ratio_vs_base_{k}"] = (
                        metrics[f"{prefix}lora_{k}_out_tok_s"] / base
                    )
        peft = baseline.get("peft_grouped_64_out_tok_s")
        if peft and "lora_64_out_tok_s" in metrics:
            metrics["speedup_vs_peft_64"] = metrics["lora_64_out_tok_s"] / peft
        write_result(
            args.out,
            "multi_lora",
            metrics,
            baseline,
            workload={
                "model": args.model,
                "num_requests": n,
                "input_uniform": [256, 1024],
                "output_uniform": [128, 512],
                "rank": 16,
                "target_modules": "q,k,v,o,gate,up,down",
                "adapters": args.adapters,
                "peft_groups_timed": args.peft_groups,
            },
        )

    if "disabled" in stages:
        llm = engine(args.model, False, 1)
        prompts, outputs = workload(llm.engine.runner.arch.vocab_size, n)
        serve(llm, prompts[:16], [16] * len(prompts[:16]))  # warm-up
        for prefix, sampling in SAMPLINGS.items():
            key = f"{prefix}base_lora_disabled_out_tok_s"
            baseline[key] = serve(llm, prompts, outputs, sampling=sampling)
            print(f"{prefix}base, LoRA disabled: {baseline[key]:.0f} tok/s")
        record()
        del llm
        gc.collect()
        torch.cuda.empty_cache()

    llm = engine(args.model, True, max(args.adapters))
    arch = llm.engine.runner.arch
    prompts, outputs = workload(arch.vocab_size, n)
    start = time.perf_counter()
    needed = max(args.adapters) if "lora" in stages else 64
    adapters = []
    for i in range(needed):
        write_random_adapter(
            folder / f"a{i}", arch, rank=16, seed=i, device=llm.engine.runner.device
        )
        adapters.append(LoRARequest(f"a{i}", str(folder / f"a{i}")))
    print(f"{needed} adapters written in {time.perf_counter() - start:.1f} s")

    if "lora" in stages:
        serve(llm, prompts[:16], [16] * len(prompts[:16]))  # warm-up
        for prefix, sampling in SAMPLINGS.items():
            key = f"{prefix}base_on_lora_engine_out_tok_s"
            metrics[key] = serve(llm, prompts, outputs, sampling=sampling)
            print(f"{prefix}base on the LoRA engine: {metrics[key]:.0f} tok/s")
        for k in args.adapters:
            start = time.perf_counter()
            serve(llm, [p[:8] for p in prompts[:k]], [2] * k, adapters[:k])  # load the slots
            print(f"{k} adapters loaded in {time.perf_counter() - start:.1f} s")
            loras = [adapters[i % k] for i in range(n)]
            for prefix, sampling in SAMPLINGS.items():
                key = f"{prefix}lora_{k}_out_tok_s"
                metrics[key] = serve(llm, prompts, outputs, loras, sampling)
                print(f"{prefix}{k} adapters: {metrics[key]:.0f} tok/s; {llm.stats()}")
            record()

    if "peft" in stages:
        from peft import PeftModel

        hf = hf_model_from_engine(llm, torch.bfloat16)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        groups = [[i for i in range(n) if i % 64 == g] for g in range(args.peft_groups)]
        model = None
        seconds, tokens = 0.0, 0
        for g, members in enumerate(groups):
            path, name = adapters[g].lora_path, adapters[g].lora_name
            if model is None:
                model = PeftModel.from_pretrained(hf, path, adapter_name=name)
                hf_generate_static(model, [prompts[0][:64]] * 8, [8] * 8)  # warm-up
            else:
                model.load_adapter(path, adapter_name=name)
            model.set_adapter(name)
            t, useful = hf_generate_static(
                model, [prompts[i] for i in members], [outputs[i] for i in members]
            )
            seconds += t
            tokens += useful
            print(f"PEFT group {g}: {useful} tokens in {t:.1f} s")
        baseline["peft_grouped_64_out_tok_s"] = tokens / seconds
        print(f"PEFT grouped: {baseline['peft_grouped_64_out_tok_s']:.1f} tok/s")
    record()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
