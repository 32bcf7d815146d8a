"""Warm-up at start: a burst like the first heavy one a server meets, run before it reports
ready, so that its first users do not pay for what is compiled or grown at first use.

The runner captures decode CUDA graphs and compiles the sampler's, the bitmask's and the LoRA
kernels when it starts. What only a real batch meets is left: Triton kernels specialised for the
token counts of prefill and mixed steps (attention over long queries, the fused rotary and KV
write, norms, GEMM shapes), eager steps above the captured batch sizes, the device allocator
grown to a full step's activations, chunked prefill of a long prompt, and the host paths of a
batch of mixed sampling parameters (penalties, top-k / top-p / min-p, seeds, logprobs). The burst
fills the batch (`max_num_seqs` requests of prompts of uneven lengths, several full prefill
steps, a prompt longer than a step, prompts over a cached prefix), each request with one of the
sampling mixes and a few output tokens, so the batch shrinks through the decode sizes as they
finish.

Afterwards the engine is as it was: no request, no cached prefix, its counters at zero.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex import envs
from loraplex.platform.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loraplex.platform.engine.engine import Engine

logger = logging.getLogger(__name__)

WARM_UP_TENANT = "loraplex-warm-up"
PREFILL_STEPS = 3  # full prefill steps of the burst (the last is mixed with decodes)
MAX_OUTPUT_TOKENS = 8  # request i generates 1 + i % 8 tokens
SHARED_PREFIX_EVERY = 10  # every tenth prompt starts with the long prompt's first two blocks
DEADLINE_S = 600.0
# The sampling fields of the burst's requests, request i taking the (i mod 7)-th.
SAMPLING_MIXES: tuple[dict, ...] = (
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
    {"temperature": 1.0, "min_p": 0.05, "seed": 7},
    {"temperature": 1.0, "repetition_penalty": 1.1},
    {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"temperature": 1.0, "logprobs": 5},
)


@dataclass(frozen=True)
class WarmUpBurst:
    """The burst's requests: prompt token ids and params, in the order they are added."""

    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.prompts) + sum(p.max_tokens or 0 for p in self.params)


def should_warm_up(device_type: str) -> bool:
    """LORAPLEX_WARM_UP, else on CUDA only (a CPU engine compiles nothing at first use)."""
    forced = envs.warm_up()
    return device_type == "cuda" if forced is None else forced


def warm_up_burst(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    kv_tokens: int,
    vocab_size: int,
    block_size: int = 16,
) -> WarmUpBurst:
    """The burst for an engine of these limits, within half of its `kv_tokens` (so it never
    preempts) and its context; prompts of ordinary token ids away from the vocabulary's ends."""
    rng = random.Random(0)
    low, high = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size * 3 // 4)
    budget = kv_tokens // 2
    room = max(1, max_model_len - MAX_OUTPUT_TOKENS - 1)  # the longest prompt with its output
    # NOTE: one prompt longer than a step prefills in chunks beside the others
    long = min(room, max_num_batched_tokens + 37)
    share = max(1, (PREFILL_STEPS * max_num_batched_tokens - long) // max_num_seqs)
    lengths = [long] + [
        max(1, min(room, share + (i % 17) - 8)) for i in range(1, max_num_seqs)
    ]  # uneven: token counts of every residue
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    used = 0
    for i, length in enumerate(lengths):
        output = 1 + i % MAX_OUTPUT_TOKENS
        need = -(-(length + output) // block_size) * block_size
        if used + need > budget:
            continue
        used += need
        prompt = [rng.randrange(low, high) for _ in range(length)]
        if prompts and i % SHARED_PREFIX_EVERY == 0:
            # NOTE: the long prompt's first blocks, cached by the time this one is scheduled:
            # a prefill over a cached prefix
            shared = min(len(prompts[0]), 2 * block_size, length - 1)
            prompt[:shared] = prompts[0][:shared]
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=output, ignore_eos=True, **SAMPLING_MIXES[i % 7]))
    return WarmUpBurst(prompts, params)


def warm_up(engine: Engine) -> float:
    """Run the warm-up burst on `engine` (idle, before it serves) to its end, then leave it as
    it was; returns the seconds it took."""
    start = time.perf_counter()
    config = engine.config.scheduler
    kv = engine.scheduler.kv
    burst = warm_up_burst(
        config.max_num_seqs,
        config.max_num_batched_tokens,
        engine.max_model_len,
        kv.num_free_blocks * engine.config.cache.block_size,
        engine.runner.arch.vocab_size,
        engine.config.cache.block_size,
    )
    for i, (prompt, params) in enumerate(zip(burst.prompts, burst.params, strict=True)):
        engine.add_request(f"warm-up-{i}", prompt, params, tenant=WARM_UP_TENANT)
    steps = 0
    deadline = start + DEADLINE_S
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the warm-up burst did not finish within {DEADLINE_S:g} s")
    engine.reset_counters()
    seconds = time.perf_counter() - start
    logger.info(
        "warmed up: %d requests, %d prompt tokens, %d steps in %.1f s",
        len(burst.prompts),
        sum(len(p) for p in burst.prompts),
        steps,
        seconds,
    )
    return seconds
