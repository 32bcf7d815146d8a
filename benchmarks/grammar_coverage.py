"""Coverage of real-world JSON schemas per grammar backend.

The corpus is public schemas we do not copy into the repository but read from where a PyPI
package ships them:

- the JSON Schema Store files that `check-jsonschema` vendors (`check_jsonschema/
  builtin_schemas/vendor/*.json`: GitHub workflows and actions, GitLab CI, Azure Pipelines,
  Renovate, compose-spec, CircleCI, ...; each file's `$id` names its upstream), and up to
  `--components` object-typed `definitions`/`$defs` of each, as standalone schemas (the shape of
  an API's component schemas), with the file's definitions alongside for their `$ref`s;
- the JSON Schema meta-schemas `jsonschema-specifications` ships (draft 4, 6, 7).

Each schema is compiled cold (a fresh cache) by each backend alone, and by the default order
(outlines-core, then llguidance): served, refused naming a feature, over the size limits, timed
out, or failed; compile time per backend. Every served grammar is walked (`RandomWalker`) and
each finished output validated with jsonschema: `invalid` must be 0.

    pip install --no-deps check-jsonschema==0.39.0      # the corpus (data only)
    python -m benchmarks.grammar_coverage                # writes cpu_grammar_coverage.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from jsonschema.validators import validator_for

from benchmarks.common.grammar_inputs import coverage_corpus, grammar_vocabulary
from benchmarks.common.stats import quantile
from benchmarks.record import write_result
from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.errors import (
    GrammarTimeoutError,
    SchemaTooLargeError,
    UnsupportedSchemaError,
)
from loraplex.grammar.walk import RandomWalker
from loraplex.platform.core.structured_outputs import StructuredOutputs

BACKENDS = {"outlines": ("outlines",), "llguidance": ("llguidance",)}
AUTO = "outlines+llguidance"


def compile_one(
    compiler: GrammarCompiler, schema: dict[str, Any], timeout_s: float
) -> tuple[str, str, float, Any]:
    """(status, detail, compile ms, grammar or None); status: served, refused, too_large,
    timeout, failed."""
    start = time.perf_counter()
    try:
        grammar = compiler.compile(StructuredOutputs(json=schema), timeout=timeout_s * 3)
    except SchemaTooLargeError as error:
        return "too_large", str(error), 0.0, None
    except UnsupportedSchemaError as error:
        return "refused", error.feature, (time.perf_counter() - start) * 1e3, None
    except GrammarTimeoutError as error:
        return "timeout", str(error), (time.perf_counter() - start) * 1e3, None
    except Exception as error:  # noqa: BLE001 - recorded: invalid schemas, limits
        return "failed", f"{type(error).__name__}: {error}"[:200], 0.0, None
    return "served", grammar.backend, (time.perf_counter() - start) * 1e3, grammar


def walk_and_validate(
    walker: RandomWalker, tokenizer, grammar, schema: dict[str, Any], walks: int
) -> Counter:
    """valid / invalid / unfinished counts of `walks` random walks through `grammar`."""
    validator = validator_for(schema)(schema)
    counts: Counter = Counter()
    for seed in range(walks):
        tokens = walker.walk(grammar, seed, max_steps=1500)
        if tokens is None:
            counts["unfinished"] += 1
            continue
        try:
            value = json.loads(tokenizer.decode(tokens))
        except json.JSONDecodeError:
            counts["invalid"] += 1
            continue
        counts["valid" if validator.is_valid(value) else "invalid"] += 1
    return counts


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "max": 0.0}
    return {
        "p50": round(statistics.median(values), 1),
        "p90": round(quantile(values, 0.9), 1),
        "max": round(max(values), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--components", type=int, default=2, help="definitions per file")
    parser.add_argument("--walks", type=int, default=3, help="random walks per served schema")
    parser.add_argument("--timeout", type=float, default=10.0, help="compile limit, seconds")
    parser.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    parser.add_argument("--out", default="cpu_grammar_coverage.json")
    args = parser.parse_args()

    from loraplex.platform.models.model_store import ensure_default_model

    tokenizer, _, vocabulary = grammar_vocabulary(
        ensure_default_model(progress=False) / "tokenizer.json"
    )
    walker = RandomWalker(tokenizer)
    entries = coverage_corpus(args.components)
    if args.limit:
        entries = entries[: args.limit]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="loraplex-grammar-coverage-") as tmp:
        for label, order in [*BACKENDS.items(), (AUTO, ("outlines", "llguidance"))]:
            config = GrammarConfig(
                compile_timeout_s=args.timeout, json_backends=order, cache_dir=Path(tmp) / label
            )
            compiler = GrammarCompiler(vocabulary, config)
            # NOTE: not timed: the child's start and llguidance's tokenizer, once per process.
            compiler.compile(StructuredOutputs(json={"type": "boolean"}), timeout=120)
            try:
                for i, (name, source, schema) in enumerate(entries):
                    status, detail, ms, grammar = compile_one(compiler, schema, args.timeout)
                    walks: Counter = Counter()
                    if grammar is not None:
                        walks = walk_and_validate(walker, tokenizer, grammar, schema, args.walks)
                    if len(rows) <= i:
                        rows.append({"schema": name, "source": source})
                    rows[i][label] = {
                        "status": status, "detail": detail, "compile_ms": round(ms, 1), **walks,
                    }  # fmt: skip
                    print(
                        f"{label:20s} {name:50s} {status:9s} {detail[:40]:40s} {ms:8.0f} ms {dict(walks)}",
                        flush=True,
                    )
            finally:
                compiler.shutdown()

    metrics: dict[str, Any] = {"corpus_size": len(entries)}
    for label in [*BACKENDS, AUTO]:
        results = [row[label] for row in rows]
        statuses = Counter(r["status"] for r in results)
        served_ms = [r["compile_ms"] for r in results if r["status"] == "served"]
        metrics[label] = {
            "served_share": round(statuses["served"] / len(results), 4),
            "refused_share": round(statuses["refused"] / len(results), 4),
            "statuses": dict(statuses),
            "invalid_outputs": sum(r.get("invalid", 0) for r in results),
            "valid_outputs": sum(r.get("valid", 0) for r in results),
            "unfinished_walks": sum(r.get("unfinished", 0) for r in results),
            "cold_compile_ms_served": _percentiles(served_ms),
            "refused_features": dict(
                Counter(r["detail"] for r in results if r["status"] == "refused").most_common(12)
            ),
        }
    metrics[AUTO]["served_by"] = dict(
        Counter(row[AUTO]["detail"] for row in rows if row[AUTO]["status"] == "served")
    )
    print(json.dumps(metrics, indent=2))
    write_result(args.out, "grammar_coverage", metrics, baseline={
        "what": "each backend alone; the default order tries outlines-core, then llguidance",
    }, tokenizer="SmolLM2-135M-Instruct", schemas=rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
