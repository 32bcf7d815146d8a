"""Grammar compile time (cold, cached in memory, cached on disk) and per-step mask fill time.

Over the test suite's JSON schemas (tests/grammar/grammar_schemas.py) with the embedded model's 49k
vocabulary, on the CPU. Cold compiles run in the child process as served; the baseline is
outlines-core compiling the same regex in-process and filling masks through its own `Guide`.

    python -m benchmarks.grammar_compile [--out cpu_grammar.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from outlines_core import Guide, Index

from benchmarks.common.grammar_inputs import grammar_vocabulary, test_suite_schemas
from benchmarks.common.stats import quantile
from benchmarks.common.timing import wall_seconds
from benchmarks.record import write_result
from loraplex.grammar.bitmask import allocate_token_bitmask, apply_token_bitmask_
from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.matcher import GrammarMatcher
from loraplex.grammar.schema_analysis import schema_regex
from loraplex.platform.core.structured_outputs import StructuredOutputs
from loraplex.platform.models.model_store import ensure_default_model

WALK_STEPS = 64


def _walk(grammar, rng: np.random.Generator) -> list[int]:
    """Token ids of a random path through the grammar, at most WALK_STEPS long."""
    matcher = GrammarMatcher(grammar)
    tokens = []
    for _ in range(WALK_STEPS):
        allowed = [
            t for t in grammar.allowed_token_ids(matcher.state) if t not in grammar.stop_token_ids
        ]
        if not allowed:
            break
        token = int(rng.choice(allowed))
        matcher.accept_token(token)
        tokens.append(token)
    return tokens


def _fill_us(
    grammar, tokens: list[int], bitmask: np.ndarray, rounds: int = 20
) -> tuple[float, float]:
    """Mean microseconds of one `fill_bitmask` per step along `tokens`: on the first visit of
    each state (its mask is built then), and the median round once masks are cached."""
    timings = []
    for _ in range(rounds + 1):
        matcher = GrammarMatcher(grammar)
        elapsed = 0.0
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            elapsed += time.perf_counter() - start
            matcher.accept_token(token)
        timings.append(elapsed / max(len(tokens), 1) * 1e6)
    return timings[0], statistics.median(timings[1:])


def _baseline_fill_us(index: Index, vocab_size: int, tokens: list[int], rounds: int = 20) -> float:
    """Mean microseconds of outlines-core's own `Guide.write_mask_into` per step."""
    mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    elapsed, steps = 0.0, 0
    for _ in range(rounds):
        guide = Guide(index)
        for token in tokens:
            start = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            elapsed += time.perf_counter() - start
            steps += 1
            guide.advance(token, return_tokens=False)
    return elapsed / max(steps, 1) * 1e6


def _apply_us(device: torch.device, rows: int, vocab_size: int, iters: int = 50) -> float:
    """Mean microseconds of `apply_token_bitmask_` on `rows` x `vocab_size` logits."""
    logits = torch.randn(rows, vocab_size, device=device)
    bitmask = allocate_token_bitmask(rows, vocab_size).to(device)
    apply_token_bitmask_(logits, bitmask)
    seconds = wall_seconds(lambda: [apply_token_bitmask_(logits, bitmask) for _ in range(iters)])
    return seconds / iters * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="cpu_grammar.json", help="in benchmarks/results/")
    args = parser.parse_args()

    _, _, vocabulary = grammar_vocabulary(ensure_default_model(progress=False) / "tokenizer.json")
    rng = np.random.default_rng(0)
    bitmask = allocate_token_bitmask(1, vocabulary.vocab_size).numpy()
    per_schema = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        config = GrammarConfig(compile_timeout_s=120, num_workers=1, cache_dir=Path(cache_dir))
        compiler = GrammarCompiler(vocabulary, config)
        compiler.compile(StructuredOutputs(regex="warm-up"))
        for name, schema in test_suite_schemas().items():
            outputs = StructuredOutputs(json=schema)
            start = time.perf_counter()
            grammar = compiler.compile(outputs)
            cold_ms = (time.perf_counter() - start) * 1e3
            start = time.perf_counter()
            compiler.compile(outputs)
            cached_ms = (time.perf_counter() - start) * 1e3
            restarted = GrammarCompiler(vocabulary, config)
            start = time.perf_counter()
            restarted.compile(outputs)
            disk_ms = (time.perf_counter() - start) * 1e3
            restarted.shutdown()
            regex = schema_regex(schema, config.whitespace_pattern, config.max_recursion_depth)
            regex = f"(?:{regex})\\x{{{ord(vocabulary.end_marker):X}}}"
            start = time.perf_counter()
            index = Index(regex, vocabulary.vocabulary)
            baseline_ms = (time.perf_counter() - start) * 1e3
            tokens = _walk(grammar, rng)
            first_fill_us, fill_us = _fill_us(grammar, tokens, bitmask)
            per_schema[name] = {
                "cold_compile_ms": round(cold_ms, 2),
                "cached_compile_ms": round(cached_ms, 4),
                "disk_cached_compile_ms": round(disk_ms, 2),
                "baseline_inprocess_compile_ms": round(baseline_ms, 2),
                "index_bytes": len(compiler.cache.get(grammar.key)),
                "mask_fill_us_per_step": round(fill_us, 2),
                "first_visit_mask_fill_us_per_step": round(first_fill_us, 2),
                "baseline_guide_mask_us_per_step": round(
                    _baseline_fill_us(index, vocabulary.vocab_size, tokens), 2
                ),
                "steps_measured": len(tokens),
            }
        compiler.shutdown()

    apply_us = _apply_us(torch.device("cpu"), 8, vocabulary.vocab_size)
    cuda_apply = {}
    if torch.cuda.is_available():
        for rows in (1, 64, 256):
            cuda_apply[f"triton_us_{rows}x{vocabulary.vocab_size}"] = round(
                _apply_us(torch.device("cuda"), rows, vocabulary.vocab_size), 2
            )

    column = lambda key: [entry[key] for entry in per_schema.values()]  # noqa: E731
    summary = {
        key: {
            "median": round(statistics.median(column(key)), 3),
            "p90": round(quantile(column(key), 0.9), 3),
            "max": round(max(column(key)), 3),
        }
        for key in (
            "cold_compile_ms",
            "cached_compile_ms",
            "disk_cached_compile_ms",
            "mask_fill_us_per_step",
            "first_visit_mask_fill_us_per_step",
        )
    }
    metrics = {
        "num_schemas": len(per_schema),
        "vocab_size": vocabulary.vocab_size,
        "summary": summary,
        "apply_bitmask_cpu_us_8x49152": round(apply_us, 1),
        "apply_bitmask_cuda": cuda_apply,
    }
    baseline = {
        "what": "outlines-core 0.2.14 in-process Index() on the same regex, and its Guide."
        "write_mask_into per step",
        "inprocess_compile_ms_median": statistics.median(column("baseline_inprocess_compile_ms")),
        "guide_mask_us_per_step_median": statistics.median(
            column("baseline_guide_mask_us_per_step")
        ),
    }
    print(json.dumps({"summary": summary, "baseline": baseline, "apply_us": apply_us}, indent=2))
    write_result(args.out, "grammar_compile", metrics, baseline, per_schema=per_schema)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
