"""Offline throughput on CPU: 32 prompts x 64 new tokens on the embedded model,
loraplex against HF transformers `generate` one prompt at a time and in padded static batches,
on the same weights, in one run.

    python -m benchmarks.throughput [--num-prompts 32] [--output-len 64]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common.hf_baseline import hf_generate_static
from benchmarks.record import write_result
from loraplex import LLM, SamplingParams
from loraplex.platform.models.model_store import ensure_default_model

TOPICS = [
    "the ocean",
    "a small robot",
    "mountains in winter",
    "a busy market",
    "old libraries",
    "the first computer",
    "a rainy city",
    "coffee",
    "honeybees",
    "the moon landing",
    "a chess game",
    "volcanoes",
    "a lighthouse keeper",
    "desert plants",
    "jazz music",
    "a train journey",
]


def make_prompts(n: int) -> list[str]:
    forms = ["Write a short story about {}.", "Explain to a child how {} works, step by step:"]
    return [forms[i % 2].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--out", default="cpu_throughput.json", help="in benchmarks/results/")
    args = parser.parse_args()
    model_dir = ensure_default_model(progress=False)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=1024, enable_lora=False)
    texts = make_prompts(args.num_prompts)
    prompts = [llm.tokenizer.encode(t) for t in texts]
    n_out = args.output_len
    params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    llm.engine.scheduler.kv.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours = time.perf_counter() - start
    total = sum(len(o.outputs[0].token_ids) for o in outs)

    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    one_time = 0.0
    for p in prompts:
        t, _ = hf_generate_static(hf, [p], [n_out], pad_id=2)
        one_time += t
    static_time = 0.0
    bs = args.hf_batch_size
    for i in range(0, len(prompts), bs):
        t, _ = hf_generate_static(
            hf, prompts[i : i + bs], [n_out] * len(prompts[i : i + bs]), pad_id=2
        )
        static_time += t
    metrics = {
        "loraplex_out_tok_s": total / ours,
        "speedup_vs_hf_one_at_a_time": one_time / ours,
        "speedup_vs_hf_static_batches": static_time / ours,
    }
    baseline = {
        "hf_one_at_a_time_out_tok_s": total / one_time,
        "hf_static_batches_out_tok_s": total / static_time,
        "hf_one_at_a_time_ms_per_token": one_time / total * 1e3,
    }
    print(metrics, baseline)
    write_result(
        args.out,
        "offline_throughput",
        metrics,
        baseline,
        workload={
            "num_prompts": args.num_prompts,
            "output_len": n_out,
            "hf_batch_size": bs,
            "torch_threads": torch.get_num_threads(),
            "load_average_at_end": os.getloadavg()[0],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
