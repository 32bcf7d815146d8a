"""Host time of the grammar path per engine step at many constrained rows.

What the engine thread does for grammar requests while the device runs a step, without a model:
`StructuredOutputManager.fill_bitmask` over N rows (the step's masks, in place) and each row's
matcher advancing by its sampled token with the stop check the scheduler makes
(`accept_token`, `is_terminated() or must_stop()`). N random walks through the outlines-core
grammar of the schema `benchmarks.grammar_throughput` measures stand in for the sampled tokens. CPU time
(`time.process_time`), best of `--repeats`, so other processes on the machine count little.

    python -m benchmarks.grammar_host_step --tokenizer-dir .bench_tokenizer [--rows 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from benchmarks.common.grammar_inputs import SCHEMA, grammar_vocabulary
from benchmarks.record import write_result
from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.platform.core.request import Request
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.structured_outputs import StructuredOutputs
from loraplex.platform.engine.structured_output import GrammarJob, StructuredOutputManager


def walks(grammar, stops: list[int], rows: int, seed: int = 0) -> list[list[int]]:
    """`rows` random token paths through `grammar`, each until only a stop token may follow."""
    rng = np.random.default_rng(seed)
    found = []
    for _ in range(rows):
        matcher, tokens = grammar.new_matcher(), []
        while len(tokens) < 256 and not matcher.must_stop():
            allowed = [t for t in grammar.allowed_token_ids(matcher.state) if t not in stops]
            token = int(rng.choice(allowed))
            matcher.accept_token(token)
            tokens.append(token)
        found.append(tokens)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="results file (default: none)")
    args = parser.parse_args()

    _, stops, vocabulary = grammar_vocabulary(args.tokenizer_dir / "tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        compiler = GrammarCompiler(vocabulary, GrammarConfig(cache_dir=Path(tmp)))
        grammar = compiler.compile(StructuredOutputs(json=SCHEMA), timeout=300)
        compiler.shutdown()
    paths = walks(grammar, stops, args.rows)
    steps = min(map(len, paths))
    manager = StructuredOutputManager(None, tuple(stops), vocabulary.vocab_size, args.rows)
    requests = []
    for i in range(args.rows):
        request = Request(str(i), [1], SamplingParams(max_tokens=300), tuple(stops), max_tokens=300)
        ready: Future = Future()
        ready.set_result(grammar)
        manager.add_request(request, GrammarJob(ready))
        requests.append(request)
    manager.poll()
    logits_rows = np.arange(args.rows, dtype=np.int64)
    best_fill = best_accept = float("inf")
    for _ in range(args.repeats):
        for request in requests:
            request.grammar = grammar.new_matcher()
        fill = accept = 0.0
        for step in range(steps):
            start = time.process_time()
            manager.fill_bitmask(requests, logits_rows)
            fill += time.process_time() - start
            start = time.process_time()
            for request, path in zip(requests, paths, strict=True):
                matcher = request.grammar
                matcher.accept_token(path[step])
                matcher.is_terminated() or matcher.must_stop()
            accept += time.process_time() - start
        best_fill, best_accept = min(best_fill, fill), min(best_accept, accept)
    per_row = 1e6 / (steps * args.rows)
    metrics = {
        "rows": args.rows,
        "steps": steps,
        "fill_us_per_row": round(best_fill * per_row, 3),
        "accept_us_per_row": round(best_accept * per_row, 3),
        "host_ms_per_step": round((best_fill + best_accept) / steps * 1e3, 4),
    }
    print(metrics)
    if args.out:
        write_result(args.out, "grammar_host_step", metrics, baseline={
            "what": "the same measurement of main at 751598e (mask_key per row, matcher.fill_bitmask "
                    "per row, accept_token reading the mask): see 'baseline_metrics'",
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
