"""Speculative decoding measured against the same engine without it: one batch's TPOT,
throughput and acceptance (`run_batch`, `record_pair`), the cost of accepting k drafts
(`verify_cost`), and the TPOT speed-up a step cost and an acceptance length give."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from benchmarks.common.timing import best_seconds_per_call
from loraplex import LLM, SamplingParams
from loraplex.platform.runner.sampling_metadata import build_sampling_metadata
from loraplex.platform.runner.verifier import verify

# Each request samples as MODES[mode][i % len]: greedy, temperature 1.0 (the `openai` SDK's
# default), and a mixed batch (greedy, t=1.0, t=0.7 with top-p 0.9, t=1.0 with top-k 50).
MODES = {
    "greedy": [dict(temperature=0.0)],
    "t1": [dict(temperature=1.0)],
    "mixed": [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.0, top_k=50),
    ],
}

# The n-gram proposer as the benchmarks run it: 4 drafts a step from prompt matches of up to 4
# tokens.
NUM_DRAFTS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": NUM_DRAFTS, "prompt_lookup_max": 4}


def record_pair(key: str, plain: dict, spec: dict, metrics: dict) -> None:
    """One workload's `run_batch` results without and with speculation, as metrics and a line."""
    for name in ("tpot_ms", "tokens_per_s"):
        metrics[f"{key}_plain_{name}"] = plain[name]
        metrics[f"{key}_spec_{name}"] = spec[name]
    metrics[f"{key}_tpot_speedup"] = plain["tpot_ms"] / spec["tpot_ms"]
    metrics[f"{key}_acceptance_rate"] = spec["acceptance_rate"]
    metrics[f"{key}_mean_acceptance_length"] = spec["mean_acceptance_length"]
    print(
        f"{key}: tpot {plain['tpot_ms']:.2f} -> {spec['tpot_ms']:.2f} ms "
        f"({metrics[f'{key}_tpot_speedup']:.2f}x), {plain['tokens_per_s']:.0f} -> "
        f"{spec['tokens_per_s']:.0f} tok/s, acceptance length "
        f"{spec['mean_acceptance_length']:.2f}"
    )


def run_batch(
    llm: LLM,
    prompts: list[str] | list[list[int]],
    mode: str,
    max_tokens: int,
    outputs: dict[int, list[int]] | None = None,
    **options: bool,
) -> dict[str, float]:
    """Generate the `prompts` at once (chat messages, or token ids sent as they are); mean
    per-request TPOT (decode time after the first token over the tokens after it), tokens,
    output tokens a second, and the speculation counters' change. `outputs` collects each
    prompt's output tokens by its index; `options`: more SamplingParams fields (ignore_eos
    for random weights)."""
    engine = llm.engine
    tok = engine.tokenizer
    before = engine.stats().spec_decoding
    ids = {}
    start = time.monotonic()
    for i, prompt in enumerate(prompts):
        sampling = MODES[mode][i % len(MODES[mode])]
        params = SamplingParams(max_tokens=max_tokens, seed=1000 + i, **sampling, **options)
        if isinstance(prompt, str):
            token_ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        else:
            token_ids = prompt
        ids[engine.add_request(None, "", params, prompt_token_ids=token_ids)] = i
    tpots, tokens = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                n = len(out.outputs[0].token_ids)
                tokens += n
                if outputs is not None:
                    outputs[ids[out.request_id]] = list(out.outputs[0].token_ids)
                if n > 1:
                    tpots.append((time.monotonic() - out.metrics.first_token_time) / (n - 1))
    wall = time.monotonic() - start
    result = {
        "tpot_ms": statistics.mean(tpots) * 1e3,
        "tokens": float(tokens),
        "tokens_per_s": tokens / wall,
    }
    after = engine.stats().spec_decoding
    if after is not None:
        drafts = after.num_draft_tokens - (before.num_draft_tokens if before else 0)
        accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
        steps = after.num_drafts - (before.num_drafts if before else 0)
        result["acceptance_rate"] = accepted / drafts if drafts else 0.0
        result["mean_acceptance_length"] = 1 + accepted / steps if steps else 1.0
    return result


def verify_cost(vocab: int, bs: int, k: int, mode: str, dev: torch.device, iters: int) -> float:
    """Seconds of the acceptance of k drafts per row over [bs * (k + 1), vocab] logits."""
    n = bs * (k + 1)
    logits = torch.randn(n, vocab, device=dev)
    temps = [MODES[mode][i % len(MODES[mode])].get("temperature", 1.0) for i in range(bs)]
    top_p = [MODES[mode][i % len(MODES[mode])].get("top_p", 1.0) for i in range(bs)]
    top_k = [MODES[mode][i % len(MODES[mode])].get("top_k", 0) for i in range(bs)]
    meta = build_sampling_metadata(bs, vocab, dev, temperature=temps, top_p=top_p, top_k=top_k)
    lens = np.full(bs, k, dtype=np.int64)
    drafts = np.random.default_rng(0).integers(0, vocab, (bs, k))
    sampling = None if mode == "greedy" else meta

    def run() -> None:
        verify(logits, lens, drafts, sampling, None)

    run()
    return best_seconds_per_call(run, iters)


def expected_speedup(plain: float, step: float, k: int, alpha: float) -> float:
    """TPOT of plain decode over that of speculation with k drafts accepted each with
    probability alpha (independently): a step emits (1 - alpha^(k+1)) / (1 - alpha) tokens."""
    return plain / (step / sum(alpha**i for i in range(k + 1)))


def alpha_for_length(k: int, length: float) -> float:
    """The per-token acceptance probability at which k drafts give `length` tokens a step."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
