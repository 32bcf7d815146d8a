"""Throughput under a JSON schema against the same workload unconstrained.

Random Llama-3.1-8B-shaped weights with a 49,152-token vocabulary and SmolLM2's tokenizer (a
grammar needs a tokenizer, and random weights have none); prompts of 64 random tokens;
temperature 1.0 with a seed per request (the `openai` SDK's default temperature).

- schema: 256 sequences, all under one realistic JSON schema (max_tokens 256), against the same
  requests unconstrained with ignore_eos, each generating exactly as many tokens as its
  constrained twin, so both runs see the same batch sizes step by step and only the grammar's
  cost differs: `json_schema_throughput_ratio`. The same with grammar overlap off (grammar
  requests lock the engine's steps) beside it, and the host time of the mask fills per step and
  per row (`mask_fill_us_per_row`).
- mixed: 512 requests (max_tokens 128), every tenth under the schema, against the same 512 with
  no schema (equal lengths as above): `mixed_json_throughput_ratio`, and the TPOT p50 of the
  unconstrained requests in both runs.

    python -m benchmarks.grammar_throughput --tokenizer-dir .bench_tokenizer
    python -m benchmarks.grammar_throughput --tokenizer-dir .bench_tokenizer --device cpu \\
        --model-config /tmp/tiny-llama.json --num-seqs 4 --mixed-requests 10 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.engine import LLAMA_8B
from benchmarks.common.grammar_inputs import CATEGORIES, SCHEMA
from benchmarks.common.model_folders import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from benchmarks.common.prompts import random_prompts
from benchmarks.common.timing import synchronize
from benchmarks.record import write_result
from loraplex import LLM, RequestOutput, SamplingParams, StructuredOutputs
from loraplex.platform.engine.structured_output import MaskFillStats


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


@dataclass(frozen=True)
class Run:
    """One timed batch: outputs in request order, wall seconds, output tokens, TPOT per
    request (seconds between its first and last token over its tokens after the first)."""

    outputs: list[RequestOutput]
    seconds: float
    tokens: int
    tpot_s: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def drive(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> Run:
    """Add every request, step the engine until all finish, timing each request's tokens."""
    engine = llm.engine
    synchronize()
    start = time.perf_counter()
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, sp)
    first: dict[str, float] = {}
    done: dict[str, tuple[RequestOutput, float]] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = (out, now)
    synchronize()
    seconds = time.perf_counter() - start
    ordered = [done[str(i)] for i in range(len(prompts))]
    tpot = []
    for out, end in ordered:
        n = len(out.outputs[0].token_ids)
        tpot.append((end - first[out.request_id]) / (n - 1) if n > 1 else 0.0)
    tokens = sum(len(out.outputs[0].token_ids) for out, _ in ordered)
    return Run([out for out, _ in ordered], seconds, tokens, tpot)


def matched(params: list[SamplingParams], run: Run) -> list[SamplingParams]:
    """The same requests with no schema, each generating exactly as many tokens as it did."""
    return [
        replace(p, structured_outputs=None, ignore_eos=True, max_tokens=len(o.outputs[0].token_ids))
        for p, o in zip(params, run.outputs, strict=True)
    ]


def set_overlap(llm: LLM, overlap: bool) -> None:
    """Grammar overlap on or off for requests added from now on (the engine reads it at add)."""
    config = llm.engine.config
    llm.engine.config = replace(config, grammar=replace(config.grammar, overlap=overlap))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        required=True,
        help="folder with tokenizer.json and tokenizer_config.json",
    )
    parser.add_argument("--model-config", type=Path, default=Path(LLAMA_8B))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--num-seqs", type=int, default=256, help="schema scenario's requests")
    parser.add_argument("--mixed-requests", type=int, default=512)
    parser.add_argument("--mixed-every", type=int, default=10, help="every n-th under a schema")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--mixed-max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
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
        config = with_smollm2_tokenizer(args.model_config, args.tokenizer_dir, Path(tmp))
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
    longest = args.prompt_len + max(args.max_tokens, args.mixed_max_tokens)
    llm = LLM(
        str(config),
        dtype="float32" if cpu else "bfloat16",
        device=args.device,
        max_model_len=longest + 64,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(2048, args.max_num_seqs * args.prompt_len),
        num_kv_blocks=2048 if cpu else None,
        gpu_memory_utilization=0.6,
        enable_lora=False,
        async_scheduling=True,
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
    num_prompts = max(args.num_seqs, args.mixed_requests)
    prompts = random_prompts(rng, SMOLLM2_VOCAB_SIZE, [args.prompt_len] * num_prompts)

    def sampling(i: int, max_tokens: int, schema: bool) -> SamplingParams:
        return SamplingParams(
            temperature=args.temperature,
            seed=1000 + i,
            max_tokens=max_tokens,
            ignore_eos=not schema,
            structured_outputs=spec if schema else None,
        )

    schema_prompts = prompts[: args.num_seqs]
    constrained = [sampling(i, args.max_tokens, True) for i in range(args.num_seqs)]
    mixed_prompts = prompts[: args.mixed_requests]
    is_schema = [i % args.mixed_every == 0 for i in range(args.mixed_requests)]
    mixed = [
        sampling(i, args.max_tokens if s else args.mixed_max_tokens, s)
        for i, s in enumerate(is_schema)
    ]
    # NOTE: the warm-up runs every batch size and every prompt of the timed runs, in both
    # grammar modes, so no timed run pays a first-time cost (a CUDA graph, a kernel variant,
    # a grammar state's first mask, a prompt's prefill that later runs find in the prefix
    # cache): the runs then differ only in what they measure.
    warm = [replace(p, max_tokens=16) for p in mixed]
    for overlap in (True, False):
        set_overlap(llm, overlap)
        drive(llm, schema_prompts, [replace(p, max_tokens=16) for p in constrained])
    set_overlap(llm, True)
    drive(llm, mixed_prompts, warm)
    drive(llm, mixed_prompts, [replace(p, structured_outputs=None) for p in warm])

    best: dict[str, Run] = {}

    def keep(name: str, result: Run) -> Run:
        if name not in best or result.tok_s > best[name].tok_s:
            best[name] = result
        return result

    stats = MaskFillStats()
    for _ in range(args.repeats):
        llm.engine.structured.stats = MaskFillStats()
        first = keep("schema", drive(llm, schema_prompts, constrained))
        if first is best["schema"]:
            stats = llm.engine.structured.stats  # the mask fills of the best run
        keep("schema_matched", drive(llm, schema_prompts, matched(constrained, first)))
        set_overlap(llm, False)
        locked = keep("schema_lock_step", drive(llm, schema_prompts, constrained))
        set_overlap(llm, True)
        keep("schema_lock_step_matched", drive(llm, schema_prompts, matched(constrained, locked)))
        with_schema = keep("mixed", drive(llm, mixed_prompts, mixed))
        keep("mixed_matched", drive(llm, mixed_prompts, matched(mixed, with_schema)))

    schema_run = best["schema"]
    completed, valid = count_valid(schema_run.outputs)
    mixed_completed, mixed_valid = count_valid(
        [o for o, s in zip(best["mixed"].outputs, is_schema, strict=True) if s]
    )
    lengths = sorted(len(o.outputs[0].token_ids) for o in schema_run.outputs)

    def free_tpot_ms(name: str) -> float:
        values = [t for t, s in zip(best[name].tpot_s, is_schema, strict=True) if not s]
        return statistics.median(values) * 1e3

    tpot_with, tpot_without = free_tpot_ms("mixed"), free_tpot_ms("mixed_matched")
    return {
        "json_schema_throughput_ratio": round(
            best["schema"].tok_s / best["schema_matched"].tok_s, 4
        ),
        "json_schema_throughput_ratio_lock_step": round(
            best["schema_lock_step"].tok_s / best["schema_lock_step_matched"].tok_s, 4
        ),
        "mixed_json_throughput_ratio": round(best["mixed"].tok_s / best["mixed_matched"].tok_s, 4),
        "mixed_unconstrained_tpot_p50_ms": round(tpot_with, 3),
        "mixed_unconstrained_tpot_p50_ms_without_schemas": round(tpot_without, 3),
        "mixed_unconstrained_tpot_ratio": round(tpot_with / tpot_without, 4),
        "constrained_output_tok_s": round(best["schema"].tok_s, 1),
        "unconstrained_matched_output_tok_s": round(best["schema_matched"].tok_s, 1),
        "lock_step_constrained_output_tok_s": round(best["schema_lock_step"].tok_s, 1),
        "mixed_output_tok_s": round(best["mixed"].tok_s, 1),
        "mixed_matched_output_tok_s": round(best["mixed_matched"].tok_s, 1),
        "mask_fill_ms_per_step": round(stats.seconds / max(stats.calls, 1) * 1e3, 4),
        "mask_fill_us_per_row": round(stats.seconds / max(stats.rows, 1) * 1e6, 3),
        "mask_rows_reused_share": round(stats.reused / max(stats.rows, 1), 4),
        "num_seqs": args.num_seqs,
        "mixed_requests": args.mixed_requests,
        "mixed_every": args.mixed_every,
        "max_num_seqs": args.max_num_seqs,
        "temperature": args.temperature,
        "completed_json_outputs": completed,
        "valid_json_outputs": valid,
        "mixed_completed_json_outputs": mixed_completed,
        "mixed_valid_json_outputs": mixed_valid,
        "constrained_output_len_median": lengths[len(lengths) // 2],
        "constrained_output_len_max": lengths[-1],
        "schema_compile_cold_ms": round(cold_ms, 2),
        "schema_compile_cached_ms": round(cached_ms, 4),
        "model": f"{args.model_config.name} with vocab_size {SMOLLM2_VOCAB_SIZE}, random weights",
        "max_tokens": args.max_tokens,
        "mixed_max_tokens": args.mixed_max_tokens,
        "prompt_len": args.prompt_len,
    }


if __name__ == "__main__":
    raise SystemExit(main())
