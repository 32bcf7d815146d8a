"""Time to first token of requests whose JSON schema the server has never seen.

Over the coverage corpus (`benchmarks.grammar_coverage`: public real-world schemas; the test
suite's schemas where its `check-jsonschema` package is absent), one request at a time, each
with a schema new to the engine's grammar compiler (a fresh compile cache per setting), request
i greedy, at temperature 1.0 or under the mixed batch's (i mod 9)-th sampling mix by turns
(`MODES`; TTFT is also reported per mode): the seconds from `add_request` to the first
generated token, with cold starts
on (the request starts under llguidance while outlines-core compiles, then hands over) and off
(it waits for its grammar). Each schema's compile is then waited for (so no compile of one
schema runs during the next one's request) and the same schema again gives the warm TTFT
(`--no-warm`: neither; compiles go on in the background, as on a busy server).
Every finished output is validated against its schema (jsonschema).

Random weights with SmolLM2's tokenizer, as `benchmarks.grammar_throughput`: an 8B Llama shape
on CUDA, a tiny Llama on the CPU (where the grammar, not the model, sets TTFT).

    python -m benchmarks.grammar_cold_ttft --tokenizer-dir .bench_tokenizer
    python -m benchmarks.grammar_cold_ttft --tokenizer-dir .bench_tokenizer --device cpu
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.engine import LLAMA_8B
from benchmarks.common.grammar_inputs import coverage_corpus, test_suite_schemas
from benchmarks.common.model_folders import SMOLLM2_VOCAB_SIZE, with_smollm2_tokenizer
from benchmarks.common.prompts import random_prompts
from benchmarks.common.sampling_mixes import MIXED, mix_fields
from benchmarks.common.stats import quantile
from benchmarks.record import write_result
from loraplex import LLM, SamplingParams, StructuredOutputs
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.errors import GrammarError
from loraplex.platform.engine.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
#: request i samples as MODES[i % 3]: greedy, temperature 1.0, the mixed batch's i-th mix
MODES = ("greedy", "t1", MIXED)
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "float32",
}  # fmt: skip


def schemas(components: int) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """(corpus name, [(schema name, schema)]): the coverage corpus, or the test suite's."""
    if importlib.util.find_spec("check_jsonschema") is not None:
        entries = coverage_corpus(components)
        return "grammar_coverage", [(name, schema) for name, _, schema in entries]
    return "tests/grammar/grammar_schemas.py", sorted(test_suite_schemas().items())


def first_token(
    engine: Engine, request_id: str, prompt: list[int], params: SamplingParams, limit_s: float
) -> dict[str, Any]:
    """Run one request alone to its end; its TTFT, status, output and grammar backends."""
    start = time.perf_counter()
    try:
        engine.add_request(request_id, prompt, params)
    except (GrammarError, ValueError) as error:  # refused at once: over the size limits
        return {"status": "refused", "detail": str(error)[:120]}
    ttft, backends, final, aborted = None, [], None, False
    while engine.has_unfinished_requests():
        if not aborted and time.perf_counter() - start > limit_s:
            engine.abort_request(request_id)
            aborted = True
        for out in engine.step():
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                final = out
        request = engine.scheduler.requests.get(request_id)
        if request is not None and request.grammar is not None:
            backend = request.grammar.grammar.backend
            if not backends or backends[-1] != backend:
                backends.append(backend)
    if final is None or final.error is not None or ttft is None:
        detail = final.error if final is not None and final.error else "no token"
        return {"status": "refused", "detail": str(detail)[:120]}
    sample = final.outputs[0]
    return {
        "status": "served", "ttft_s": ttft, "text": sample.text,
        "finish_reason": sample.finish_reason, "backends": backends,
    }  # fmt: skip


def _validates(schema: dict[str, Any], text: str) -> bool:
    from jsonschema.validators import validator_for

    try:
        return validator_for(schema)(schema).is_valid(json.loads(text))
    except json.JSONDecodeError:
        return False


def run_setting(
    llm: LLM, entries: list[tuple[str, dict[str, Any]]], config: GrammarConfig, args
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Every schema cold, then again warm, under `config`; (metrics, per-schema rows)."""
    engine = llm.engine
    engine.structured.reconfigure(config)
    compiler = engine.structured.compiler
    # NOTE: not timed: the children's start and llguidance's tokenizer, once per server (a
    # server starts them when it starts: `StructuredOutputManager.prepare`).
    compiler.compile(StructuredOutputs(json={"type": "boolean"}), timeout=120)
    if not compiler.wait_warm(120):
        raise RuntimeError("the cold-start child did not warm up in 120 s")
    stats_before = replace(engine.structured.cold_start_stats)
    rng = random.Random(0)
    rows = []
    for i, (name, schema) in enumerate(entries):
        [prompt] = random_prompts(rng, SMOLLM2_VOCAB_SIZE, [args.prompt_len])
        mode = MODES[i % len(MODES)]
        fields = {"seed": i, **mix_fields(mode, i // len(MODES))}
        params = SamplingParams(
            max_tokens=args.max_tokens, structured_outputs=StructuredOutputs(json=schema),
            **fields,
        )  # fmt: skip
        cold = first_token(engine, f"cold-{i}", prompt, params, args.request_limit_s)
        row = {"schema": name, "mode": mode, **{k: v for k, v in cold.items() if k != "text"}}
        if cold["status"] == "served" and cold["finish_reason"] == "stop":
            row["valid"] = _validates(schema, cold["text"])
        if cold["status"] == "served" and args.warm:
            try:
                compiler.compile(params.structured_outputs, timeout=args.request_limit_s)
            except GrammarError:
                pass  # NOTE: served by its cold-start grammar; the next request is too
            warm = first_token(engine, f"warm-{i}", prompt, params, args.request_limit_s)
            row["warm_ttft_s"] = warm.get("ttft_s")
        rows.append(row)
        print(json.dumps(row), flush=True)
    stats = engine.structured.cold_start_stats
    served = [r for r in rows if r["status"] == "served"]
    cold_ms = [r["ttft_s"] * 1e3 for r in served]
    warm_ms = [r["warm_ttft_s"] * 1e3 for r in served if r.get("warm_ttft_s") is not None]
    finished = [r for r in served if "valid" in r]
    metrics = {
        "schemas": len(rows),
        "served": len(served),
        "cold_ttft_p50_ms": round(statistics.median(cold_ms), 1) if cold_ms else 0.0,
        "cold_ttft_p90_ms": round(quantile(cold_ms, 0.9), 1) if cold_ms else 0.0,
        "cold_ttft_p99_ms": round(quantile(cold_ms, 0.99), 1) if cold_ms else 0.0,
        "cold_ttft_max_ms": round(max(cold_ms), 1) if cold_ms else 0.0,
        "warm_ttft_p50_ms": round(statistics.median(warm_ms), 1) if warm_ms else 0.0,
        "finished_outputs": len(finished),
        "invalid_outputs": sum(not r["valid"] for r in finished),
        "cold_starts": stats.started - stats_before.started,
        "handed_over": stats.handed_over - stats_before.handed_over,
        "hand_over_refused": stats.refused - stats_before.refused,
    }
    for mode in MODES:
        ms = [r["ttft_s"] * 1e3 for r in served if r["mode"] == mode]
        if ms:
            metrics[f"{mode}_cold_ttft_p50_ms"] = round(statistics.median(ms), 1)
            metrics[f"{mode}_cold_ttft_max_ms"] = round(max(ms), 1)
    return metrics, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--model-config",
        type=Path,
        default=None,
        help="default: configs/models/llama-3.1-8b.json on CUDA, a tiny Llama on CPU",
    )
    parser.add_argument("--components", type=int, default=2, help="definitions per corpus file")
    parser.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    parser.add_argument("--settings", default="on,off", help="cold starts: on, off, or both")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-limit-s", type=float, default=90.0)
    parser.add_argument(
        "--warm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after each cold request wait for its compile, then time the same "
        "schema again (--no-warm: on to the next schema while it compiles)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="results file (default: h200_grammar_cold_ttft.json on CUDA, "
        "cpu_grammar_cold_ttft.json on CPU)",
    )
    parser.add_argument("--note", default="", help="recorded beside the figures (e.g. the load)")
    args = parser.parse_args()  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.grammar_cold_ttft needs a CUDA GPU (or --device cpu); skipped")
        return 0
    cpu = args.device == "cpu"
    corpus_name, entries = schemas(args.components)
    if args.limit:
        entries = entries[: args.limit]
    metrics: dict[str, float] = {}
    per_schema: dict[str, list[dict[str, Any]]] = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="loraplex-cold-ttft-") as tmp:
        config_path = Path(tmp) / "base.json"
        if args.model_config is not None:
            config_path.write_text(args.model_config.read_text())
        elif cpu:
            config_path.write_text(json.dumps(TINY_LLAMA))
        else:
            config_path.write_text((ROOT / LLAMA_8B).read_text())
        model = with_smollm2_tokenizer(config_path, args.tokenizer_dir, Path(tmp))
        llm = LLM(
            str(model), dtype="float32" if cpu else "bfloat16", device=args.device,
            max_model_len=args.prompt_len + args.max_tokens + 64, max_num_seqs=8,
            num_kv_blocks=256 if cpu else None, gpu_memory_utilization=0.5, enable_lora=False,
            async_scheduling=True, seed=0,
        )  # fmt: skip
        llm.generate([1, 2, 3], SamplingParams(max_tokens=4))  # the model's first-step costs
        for setting in args.settings.split(","):
            config = GrammarConfig(cold_start=setting == "on", cache_dir=Path(tmp) / setting)
            found, rows = run_setting(llm, entries, config, args)
            metrics.update({f"cold_start_{setting}_{k}": v for k, v in found.items()})
            per_schema[setting] = rows
        llm.shutdown()
    metrics["load_average_1min_at_start"] = round(load, 2)
    print(json.dumps(metrics, indent=2))
    out = args.out or ("cpu_grammar_cold_ttft.json" if cpu else "h200_grammar_cold_ttft.json")
    write_result(out, "grammar_cold_ttft", metrics, baseline={
        "what": "cold_start_off: the same requests waiting for their grammar (outlines-core "
                "first, llguidance for what it refuses), as before cold starts",
    }, corpus=corpus_name, note=args.note, per_schema=per_schema)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
