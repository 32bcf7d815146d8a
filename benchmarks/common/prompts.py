"""The benchmarks' requests: random token-id prompts, nano-vllm's workload, and a batch's
SamplingParams under a sampling mix."""

from __future__ import annotations

import random
from collections.abc import Sequence

from benchmarks.common.sampling_mixes import GREEDY, mix_fields
from loraplex import SamplingParams


def token_prompts(
    rng: random.Random, lengths: Sequence[int], low: int, high: int
) -> list[list[int]]:
    """One prompt per length, of token ids drawn uniformly from [low, high)."""
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


def random_prompts(rng: random.Random, vocab: int, lengths: Sequence[int]) -> list[list[int]]:
    """Token ids away from both ends of a `vocab`-token vocabulary, where special tokens sit."""
    return token_prompts(rng, lengths, 100, vocab - 100)


def serving_prompts(num: int, input_len: int, seed: int) -> list[list[int]]:
    """The serving benchmarks' prompts: token ids in [1000, 40000), ordinary tokens of every
    vocabulary they serve (SmolLM2's 49k, Llama-3's 128k)."""
    return token_prompts(random.Random(seed), [input_len] * num, 1000, 40000)


def nano_vllm_workload(
    vocab: int, num_requests: int, sampling: dict = GREEDY
) -> tuple[list[list[int]], list[SamplingParams], int]:
    """nano-vllm's workload: input and output lengths uniform in [100, 1024], ignore_eos,
    greedy unless `sampling` says otherwise; returns (prompts, params, output tokens)."""
    wl = random.Random(1)
    lens = [(wl.randint(100, 1024), wl.randint(100, 1024)) for _ in range(num_requests)]
    prompts = random_prompts(wl, vocab, [i for i, _ in lens])
    return (
        prompts,
        [SamplingParams(max_tokens=o, **sampling) for _, o in lens],
        sum(o for _, o in lens),
    )


def mix_params(mix: str, max_tokens: Sequence[int]) -> list[SamplingParams]:
    """Request i's SamplingParams under `mix` (`sampling_mixes`): its fields, `max_tokens[i]`
    tokens, ignore_eos."""
    return [
        SamplingParams(max_tokens=n, ignore_eos=True, **mix_fields(mix, i))
        for i, n in enumerate(max_tokens)
    ]
