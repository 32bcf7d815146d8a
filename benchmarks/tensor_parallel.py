"""Tensor parallelism: decode throughput and step time at several tensor-parallel sizes, on the
same model (random weights from one seed are the same full weights at every size), greedy,
at temperature 1.0 and in a mixed-sampling batch.

    # CPU, the record in benchmarks/results/cpu_tensor_parallel.json (the embedded model has 9
    # attention heads and 3 KV heads: sizes 1 and 3)
    python -m benchmarks.tensor_parallel --tp 1,3
    # H200s: Llama-3.1-8B and a 70B-shaped random model
    python -m benchmarks.tensor_parallel --model configs/models/llama-3.1-8b.json --tp 1,2,4,8 \
        --num-prompts 64 --output-len 128 --out h200_tensor_parallel_8b.json
    python -m benchmarks.tensor_parallel --model configs/models/llama-3.1-70b.json --tp 2,4,8 \
        --num-prompts 64 --output-len 128 --out h200_tensor_parallel_70b.json

Each size runs in this process after the previous one is shut down (its ranks stopped, its
process group destroyed). The figure of a size is its output tokens per second over the decode
of all prompts; `vs_first` compares it with the first size given.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.record import write_result
from loraplex import LLM, SamplingParams
from loraplex.platform.models.model_store import ensure_default_model

CASES = ("greedy", "temperature_1", "mixed")


def case_params(case: str, n: int, output_len: int) -> list[SamplingParams]:
    """The batch's sampling parameters: all greedy, all at temperature 1.0 (the SDK default),
    or a mix of greedy, t=1.0, nucleus and penalised rows."""
    common = {"max_tokens": output_len, "ignore_eos": True}
    if case == "greedy":
        return [SamplingParams(temperature=0.0, **common) for _ in range(n)]
    if case == "temperature_1":
        return [SamplingParams(temperature=1.0, seed=i, **common) for i in range(n)]
    mix = [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.1},
    ]
    return [SamplingParams(seed=i, **mix[i % len(mix)], **common) for i in range(n)]


def run_size(args: argparse.Namespace, model: str, tp: int) -> dict[str, float]:
    llm = LLM(
        model,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=tp,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=max(args.num_prompts, 1),
        enable_lora=False,
        enforce_eager=args.enforce_eager,
    )
    try:
        vocab = llm.engine.runner.arch.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(100, vocab - 100, (args.input_len,), generator=gen).tolist()
            for _ in range(args.num_prompts)
        ]
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
        out: dict[str, float] = {}
        for case in CASES:
            llm.engine.scheduler.kv.reset_prefix_cache()
            params = case_params(case, args.num_prompts, args.output_len)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            out[f"{case}_tok_s"] = round(tokens / seconds, 2)
            out[f"{case}_s"] = round(seconds, 3)
            print(f"tp={tp} {case}: {tokens} tokens in {seconds:.2f} s", flush=True)
        return out
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a folder or a config.json (random weights)")
    parser.add_argument("--tp", default="1,3", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", default=None, help="the record (default by device)")
    args = parser.parse_args()
    model = args.model or str(ensure_default_model(progress=False))
    cuda = torch.cuda.is_available() and args.device != "cpu"
    if args.num_kv_blocks is None and not cuda:
        args.num_kv_blocks = 1024
    sizes = [int(s) for s in args.tp.split(",")]
    by_size = {}
    for tp in sizes:
        by_size[tp] = run_size(args, model, tp)
        print(f"tp={tp}: {by_size[tp]}", flush=True)
    first = sizes[0]
    metrics: dict[str, float] = {}
    for tp, figures in by_size.items():
        for key, value in figures.items():
            metrics[f"tp{tp}_{key}"] = value
        for case in CASES:
            ratio = figures[f"{case}_tok_s"] / by_size[first][f"{case}_tok_s"]
            metrics[f"tp{tp}_{case}_vs_tp{first}"] = round(ratio, 3)
    name = args.out or ("h200_tensor_parallel.json" if cuda else "cpu_tensor_parallel.json")
    write_result(
        name,
        "tensor_parallel",
        metrics,
        baseline={"tensor_parallel_size": first},
        model=args.model or "SmolLM2-135M-Instruct (embedded)",
        sizes=sizes,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        gpus=torch.cuda.device_count() if cuda else 0,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
