"""The engine the GPU benchmarks measure: random weights of a real model's shape (a config file
in configs/models/ builds them on the device), and the decode figure every GPU benchmark
reports beside its own."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from benchmarks.common.prompts import random_prompts
from benchmarks.common.sampling_mixes import GREEDY
from benchmarks.common.timing import best_seconds_per_call, wall_seconds
from loraplex import LLM, SamplingParams
from loraplex.platform.models.arch_config import ArchConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
LLAMA_8B = "configs/models/llama-3.1-8b.json"  # relative to the repository root, as run
# bf16, no LoRA, a 4096-token context, seed 0, and room left on the device for a baseline
# (HF, a second engine) holding the same weights.
BENCH_ENGINE = dict(
    dtype="bfloat16", enable_lora=False, max_model_len=4096, gpu_memory_utilization=0.55, seed=0
)
DECODE_STEPS, DECODE_PROMPT_LEN = 256, 32


def bench_llm(model: str | None, **options) -> LLM:
    """An engine on `model` with `BENCH_ENGINE`'s options, `options` overriding them."""
    return LLM(model, **{**BENCH_ENGINE, **options})


def resolve_model(name: str | None) -> str | None:
    """A path, or the name of a config in configs/models/ (`qwen3-0.6b`); None: the default."""
    if name is None or Path(name).exists():
        return name
    config = CONFIGS / f"{name}.json"
    if config.is_file():
        return str(config)
    known = sorted(p.stem for p in CONFIGS.glob("*.json"))
    raise SystemExit(f"unknown model {name!r}: give a path or one of {known}")


def projection_shapes(model: str) -> list[tuple[int, int]]:
    """(N, K) of a decoder layer's four projections (qkv, o, gate-up, down) and the output
    head, for the model config file `model`."""
    a = ArchConfig.from_dict(json.loads(Path(model).read_text()))
    return [
        (a.q_size + 2 * a.kv_size, a.hidden_size),
        (a.hidden_size, a.q_size),
        (2 * a.intermediate_size, a.hidden_size),
        (a.hidden_size, a.intermediate_size),
        (a.vocab_size, a.hidden_size),
    ]


def decode_tpot(
    llm: LLM, rng: random.Random, sampling: dict = GREEDY, steps: int = DECODE_STEPS
) -> tuple[float, float | None]:
    """(seconds per output token at batch 1, GPU seconds of one graph-replayed decode step):
    (time of steps + 1 tokens - time of 1) / steps, median of 3; `sampling` holds the
    SamplingParams fields of the requests (greedy by default)."""
    vocab = llm.engine.runner.arch.vocab_size

    def one(n: int) -> float:
        prompt = random_prompts(rng, vocab, [DECODE_PROMPT_LEN])
        return wall_seconds(lambda: llm.generate(prompt, SamplingParams(max_tokens=n, **sampling)))

    one(8)
    tpot = statistics.median((one(steps + 1) - one(1)) / steps for _ in range(3))
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return tpot, None
    return tpot, best_seconds_per_call(graphs.graphs[1].replay, iters=20)
