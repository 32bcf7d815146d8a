"""Quality of each quantized format on CPU: the embedded SmolLM2-135M-Instruct is
quantized with `loraplex quantize`'s code into every format, served by `LLM`, and scored by
teacher-forced perplexity on a fixed text and greedy agreement with the bf16 model on 8 prompts
(`benchmarks.common.quality`).

    python -m benchmarks.quant_quality [--max-tokens 32] [--formats awq_w4g64,fp8_channel]

The dense model runs twice: in bfloat16 (the baseline the formats are compared with) and in float32. The
quantized models run with float32 activations (their weights are dequantized to float32 on
CPU), so their distance from `fp32` is the weight format's own error, and their distance from
`bf16` adds bf16's rounding of the dense weights and activations.

NOTE: SmolLM2's hidden size is 576, which groups of 128 do not divide, so the 4-bit formats use
groups of 64 (the names say so).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.quality import (
    GREEDY_PROMPTS,
    QUALITY_TEXT,
    greedy_agreement,
    greedy_continuations,
    perplexity,
)
from benchmarks.record import write_result
from loraplex import LLM
from loraplex.platform.models.model_store import ensure_default_model
from loraplex.quant.quantize import quantize_model

FORMATS: dict[str, dict[str, Any]] = {
    "awq_w4g64": {"method": "awq", "group_size": 64},
    "gptq_w4g64": {"method": "gptq", "bits": 4, "group_size": 64},
    "gptq_w8": {"method": "gptq", "bits": 8, "group_size": -1},
    "fp8_channel": {"method": "fp8", "fp8_scheme": "per_channel"},
    "fp8_block128": {"method": "fp8", "fp8_scheme": "block"},
}


@dataclass(frozen=True)
class Score:
    perplexity: float
    continuations: list[list[int]]  # greedy token ids per prompt
    num_scored_tokens: int
    seconds: float


def score(model: Path, dtype: str, max_tokens: int) -> Score:
    """Perplexity and greedy continuations of one checkpoint served by `LLM`."""
    start = time.perf_counter()
    llm = LLM(str(model), dtype=dtype, device="cpu", num_kv_blocks=512, enable_lora=False)
    ppl = perplexity(llm)
    tokens = greedy_continuations(llm, GREEDY_PROMPTS, max_tokens)
    num_scored = len(llm.tokenizer.encode(QUALITY_TEXT)) - 1
    return Score(ppl, tokens, num_scored, time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--out", default="cpu_quant_quality.json", help="in benchmarks/results/")
    args = parser.parse_args()
    names = [n for n in args.formats.split(",") if n]
    unknown = sorted(set(names) - set(FORMATS))
    if unknown:
        raise ValueError(f"unknown formats {unknown}; choose from {sorted(FORMATS)}")
    model_dir = ensure_default_model(progress=False)
    metrics: dict[str, float] = {}
    seconds: dict[str, float] = {}
    bf16 = score(model_dir, "bfloat16", args.max_tokens)
    fp32 = score(model_dir, "float32", args.max_tokens)
    seconds.update(bf16=bf16.seconds, fp32=fp32.seconds)
    metrics["ppl_bf16"] = bf16.perplexity
    metrics["ppl_fp32"] = fp32.perplexity
    fp32_vs_bf16 = greedy_agreement(bf16.continuations, fp32.continuations)
    metrics["greedy_agreement_fp32"] = fp32_vs_bf16.prefix_agreement
    metrics["greedy_exact_fp32"] = fp32_vs_bf16.exact_matches
    metrics["greedy_first_token_fp32"] = fp32_vs_bf16.first_token_matches
    with tempfile.TemporaryDirectory(prefix="loraplex-quality-") as tmp:
        for name in names:
            start = time.perf_counter()
            path = quantize_model(model_dir, Path(tmp) / name, progress=False, **FORMATS[name])
            seconds[f"quantize_{name}"] = time.perf_counter() - start
            quant = score(path, "float32", args.max_tokens)
            seconds[name] = quant.seconds
            vs_bf16 = greedy_agreement(bf16.continuations, quant.continuations)
            vs_fp32 = greedy_agreement(fp32.continuations, quant.continuations)
            metrics[f"ppl_{name}"] = quant.perplexity
            metrics[f"ppl_ratio_vs_fp32_{name}"] = quant.perplexity / fp32.perplexity
            metrics[f"greedy_agreement_{name}"] = vs_bf16.prefix_agreement
            metrics[f"greedy_exact_{name}"] = vs_bf16.exact_matches
            metrics[f"greedy_first_token_{name}"] = vs_bf16.first_token_matches
            metrics[f"greedy_agreement_vs_fp32_{name}"] = vs_fp32.prefix_agreement
            print(f"{name}: ppl {quant.perplexity:.3f}, greedy vs bf16 {vs_bf16}")
    print(metrics)
    write_result(
        args.out,
        "quant_quality",
        metrics,
        {"ppl_bf16": bf16.perplexity, "ppl_fp32": fp32.perplexity},
        workload={
            "model": "SmolLM2-135M-Instruct (embedded)",
            "text_tokens_scored": bf16.num_scored_tokens,
            "num_prompts": len(GREEDY_PROMPTS),
            "max_tokens": args.max_tokens,
            "dense_dtypes": ["bfloat16", "float32"],
            "quantized_activation_dtype": "float32",
            "formats": {name: FORMATS[name] for name in names},
            "greedy_reference": "bf16 (greedy_agreement_*), fp32 (greedy_agreement_vs_fp32_*)",
            "seconds": seconds,
            "torch_threads": torch.get_num_threads(),
            "load_average_at_end": os.getloadavg()[0],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
