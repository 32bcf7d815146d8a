"""Throughput under a JSON schema against the same workload unconstrained (issue 7).

64 requests of 64 random prompt tokens, temperature 0.7 with a seed each, max_tokens 256, all
under one realistic JSON schema, on random Llama-3.1-8B-shaped weights with a 49,152-token
vocabulary and SmolLM2's tokenizer (a grammar needs a tokenizer, and random weights have none).

The headline ratio compares equal work: the unconstrained run generates, with ignore_eos, exactly
as many tokens per request as its constrained twin did, so both runs see the same batch sizes
step by step and only the grammar's cost differs. The run the issue names (every unconstrained
request to max_tokens) is recorded beside it.

    python -m benchmarks.grammar_throughput --tokenizer-dir .bench_tokenizer
    python -m benchmarks.grammar_throughput --tokenizer-dir .bench_tokenizer --device cpu \\
        --model-config /tmp/tiny-llama.json --num-requests 4 --max-tokens 48   # a path check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import write_result
from loraplex import LLM, RequestOutput, SamplingParams, StructuredOutputs

VOCAB_SIZE = 49152
CATEGORIES = ["book", "film", "music", "game", "podcast"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 32},
        "category": {"enum": CATEGORIES},
        "rating": {"type": "integer", "minimum": 1, "maximum": 10},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "available": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["title", "category", "rating", "year", "available", "tags"],
    "additionalProperties": False,
}


def model_folder(config_path: Path, tokenizer_dir: Path, into: Path) -> Path:
    """A config file with the tokenizer's vocabulary and special ids, beside the tokenizer
    files; returns the config's path (a `.json` model path builds random weights)."""
    config = json.loads(config_path.read_text())
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}

    def special_id(name: str) -> int:
        token = tokenizer_config[name]
        return ids[token["content"] if isinstance(token, dict) else token]

    config.update(
        vocab_size=VOCAB_SIZE,
        bos_token_id=special_id("bos_token"),
        eos_token_id=[special_id("eos_token")],
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, into / name)
    path = into / "config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def is_valid(value: Any) -> bool:
    """`value` satisfies SCHEMA (checked by hand: the GPU image has no jsonschema)."""
    props = SCHEMA["properties"]
    return (
        isinstance(value, dict)
        and set(value) == set(props)
        and isinstance(value["title"], str)
        and len(value["title"]) <= props["title"]["maxLength"]
        and value["category"] in CATEGORIES
        and _int_in(value["rating"], props["rating"])
        and _int_in(value["year"], props["year"])
        and isinstance(value["available"], bool)
        and isinstance(value["tags"], list)
        and len(value["tags"]) <= props["tags"]["maxItems"]
        and all(isinstance(t, str) and len(t) <= 12 for t in value["tags"])
    )


def _int_in(value: Any, schema: dict[str, int]) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and schema["minimum"] <= value <= schema["maximum"]
    )


def count_valid(outputs: list[RequestOutput]) -> tuple[int, int]:
    """(completed outputs, completed outputs that parse and validate)."""
    completed = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    valid = 0
    for sample in completed:
        try:
            valid += is_valid(json.loads(sample.text))
        except json.JSONDecodeError:
            pass
    return len(completed), valid


class MaskFillTimer:
    """Wraps the engine's bitmask fill to time it: one call per step with constrained rows."""

    def __init__(self, fill: Callable[..., dict]) -> None:
        self._fill = fill
        self.calls = 0
        self.rows = 0
        self.seconds = 0.0

    def __call__(self, requests: list) -> dict:
        if not requests:
            return self._fill(requests)
        start = time.perf_counter()
        out = self._fill(requests)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.rows += len(requests)
        return out


def timed_generate(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[RequestOutput], float, int]:
    """(outputs, seconds, output tokens) of one batch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return outputs, seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        required=True,
        help="folder with tokenizer.json and tokenizer_config.json",
    )
    parser.add_argument(
        "--model-config", type=Path, default=Path("configs/models/llama-3.1-8b.json")
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best counts")
    parser.add_argument(
        "--out",
        default=None,
        help="results file name (default: h200_grammar.json on CUDA, none on CPU)",
    )
    args = parser.parse_args()  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.grammar_throughput needs a CUDA GPU (or --device cpu); skipped")
        return 0
    out = args.out or ("h200_grammar.json" if args.device == "cuda" else None)

    with tempfile.TemporaryDirectory(prefix="loraplex-grammar-bench-") as tmp:
        # NOTE: a fresh cache folder, so the first compile below is a cold one.
        os.environ["LORAPLEX_CACHE_DIR"] = str(Path(tmp) / "cache")
        config = model_folder(args.model_config, args.tokenizer_dir, Path(tmp))
        metrics = run(args, config)
    print(json.dumps(metrics, indent=2))
    if out:
        write_result(out, "grammar_throughput", metrics, baseline={
            "what": "the same prompts and sampling without the schema, ignore_eos, "
                    "each request as many tokens as its constrained twin",
        }, schema=SCHEMA)  # fmt: skip
    return 0


def run(args: argparse.Namespace, config: Path) -> dict[str, Any]:
    cpu = args.device == "cpu"
    llm = LLM(
        str(config),
        dtype="float32" if cpu else "bfloat16",
        device=args.device,
        max_model_len=args.prompt_len + args.max_tokens + 64,
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=max(2048, args.num_requests * args.prompt_len),
        num_kv_blocks=2048 if cpu else None,
        gpu_memory_utilization=0.5,
        enable_lora=False,
        seed=0,
    )
    spec = StructuredOutputs(json=SCHEMA)
    compiler = llm.engine.structured.compiler
    start = time.perf_counter()
    compiler.compile(spec)
    cold_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.compile(StructuredOutputs(json=dict(SCHEMA)))
    cached_ms = (time.perf_counter() - start) * 1e3

    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, VOCAB_SIZE - 100) for _ in range(args.prompt_len)]
        for _ in range(args.num_requests)
    ]

    def sampling(i: int, **kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.7, seed=1000 + i, **kw)

    constrained = [
        sampling(i, max_tokens=args.max_tokens, structured_outputs=spec)
        for i in range(len(prompts))
    ]
    full = [sampling(i, max_tokens=args.max_tokens, ignore_eos=True) for i in range(len(prompts))]
    for params in (constrained, full):  # warm-up: kernels, graphs, the grammar's states
        llm.generate(prompts[:8], [replace(p, max_tokens=16) for p in params[:8]])

    timer = MaskFillTimer(llm.engine.structured.fill_bitmasks)
    llm.engine.structured.fill_bitmasks = timer  # type: ignore[method-assign]
    best: dict[str, float] = {"constrained": 0.0, "matched": 0.0, "full": 0.0}
    for _ in range(args.repeats):
        outputs, seconds, tokens = timed_generate(llm, prompts, constrained)
        best["constrained"] = max(best["constrained"], tokens / seconds)
        matched = [
            sampling(i, max_tokens=len(o.outputs[0].token_ids), ignore_eos=True)
            for i, o in enumerate(outputs)
        ]
        _, seconds, tokens = timed_generate(llm, prompts, matched)
        best["matched"] = max(best["matched"], tokens / seconds)
        _, seconds, tokens = timed_generate(llm, prompts, full)
        best["full"] = max(best["full"], tokens / seconds)
    completed, valid = count_valid(outputs)
    lengths = sorted(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "json_schema_throughput_ratio": round(best["constrained"] / best["matched"], 4),
        "json_schema_throughput_ratio_vs_full_length": round(best["constrained"] / best["full"], 4),
        "constrained_output_tok_s": round(best["constrained"], 1),
        "unconstrained_matched_output_tok_s": round(best["matched"], 1),
        "unconstrained_full_length_output_tok_s": round(best["full"], 1),
        "mask_fill_ms_per_step": round(timer.seconds / max(timer.calls, 1) * 1e3, 4),
        "mask_fill_us_per_row": round(timer.seconds / max(timer.rows, 1) * 1e6, 3),
        "num_requests": len(prompts),
        "completed_json_outputs": completed,
        "valid_json_outputs": valid,
        "constrained_output_len_median": lengths[len(lengths) // 2],
        "constrained_output_len_max": lengths[-1],
        "schema_compile_cold_ms": round(cold_ms, 2),
        "schema_compile_cached_ms": round(cached_ms, 4),
        "model": f"{args.model_config.name} with vocab_size {VOCAB_SIZE}, random weights",
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
    }


if __name__ == "__main__":
    raise SystemExit(main())
