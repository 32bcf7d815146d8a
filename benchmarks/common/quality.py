"""How much a quantized model drifts from its dense original, measured through `LLM`.

Two figures, both taken through the engine's public API so they measure what a user is served:
- perplexity of a fixed text under teacher forcing (`perplexity`), and
- agreement of greedy continuations of fixed prompts (`greedy_continuations`,
  `greedy_agreement`).

It sits on top of the engine and imports `LLM`, so it lives with the benchmarks, not in
`loraplex.quant` (which knows weight formats, not engines).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.engine.llm import LLM

# Plain English prose written for this measurement (about 300 tokens with SmolLM2's tokenizer).
QUALITY_TEXT = (
    "Every spring the river that runs past our village rises with melted snow from the hills. "
    "For a few weeks the water is brown and fast, and the children are told to keep away from "
    "the bank. The old stone bridge has stood for more than two hundred years, and people say "
    "it was built by a farmer who was tired of losing his sheep to the current. Nobody knows if "
    "the story is true, but the bridge is still there, and every year someone paints a small "
    "white sheep on the middle stone.\n\n"
    "In summer the river becomes slow and clear. Families bring baskets of bread, cheese and "
    "fruit, and they sit in the shade of the willow trees while the younger children catch "
    "small fish with their hands. The fish are always put back. In the evening the light turns "
    "gold, the swallows fly low over the water, and the air smells of cut grass. When the sun "
    "goes down, people walk home slowly, talking about the weather and the harvest.\n\n"
    "Autumn brings rain and the first cold mornings. The leaves of the willows turn yellow and "
    "fall into the water, where they drift past the mill and out of sight. The miller, who is "
    "now almost eighty, still opens his door at six every morning. He says that a river teaches "
    "patience, because it never hurries and it never stops. Most of the village agrees with "
    "him, although the children think he simply likes to tell the same story every year."
)


# Eight fixed prompts of different kinds for greedy continuations.
GREEDY_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "The most important thing to remember when learning a new language is",
    "Here is a short list of fruits: apples, bananas,",
)


@dataclass(frozen=True)
class GreedyAgreement:
    """How closely a candidate's greedy continuations follow the reference's.

    For each prompt, `prefix` is the number of leading tokens the two continuations share (up to
    the first position where they differ or one of them ends), and `length` the longer of the two
    lengths. `prefix_agreement` is sum(prefix) / sum(length): the fraction of positions that agree
    before the first divergence, pooled over prompts (1.0 = identical). `exact_matches` counts
    prompts whose continuations are token for token identical, lengths included, and
    `first_token_matches` those whose first tokens agree (both empty counts as agreeing).
    """

    prefix_agreement: float
    exact_matches: int
    first_token_matches: int
    num_prompts: int


def perplexity_from_logprobs(logprobs: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood of the scored tokens (natural log)."""
    if not logprobs:
        raise ValueError("perplexity needs at least one token logprob")
    if any(lp > 0.0 or math.isnan(lp) for lp in logprobs):
        raise ValueError("token logprobs must be <= 0 and not NaN")
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy_agreement(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> GreedyAgreement:
    """Compare two sets of continuations of the same prompts (see `GreedyAgreement`)."""
    if len(reference) != len(candidate):
        raise ValueError(
            f"{len(reference)} reference continuations but {len(candidate)} candidate ones"
        )
    if not reference:
        raise ValueError("greedy agreement needs at least one continuation")
    shared = total = exact = first = 0
    for ref, cand in zip(reference, candidate):
        prefix = 0
        for a, b in zip(ref, cand):
            if a != b:
                break
            prefix += 1
        shared += prefix
        total += max(len(ref), len(cand))
        exact += list(ref) == list(cand)
        first += list(ref[:1]) == list(cand[:1])
    agreement = shared / total if total else 1.0
    return GreedyAgreement(agreement, exact, first, len(reference))


def greedy_continuations(
    llm: LLM, prompts: Sequence[str] = GREEDY_PROMPTS, max_tokens: int = 32
) -> list[list[int]]:
    """Token ids of each prompt's greedy continuation (at most `max_tokens`, EOS ends it)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [out.outputs[0].token_ids for out in llm.generate(list(prompts), params)]


def token_logprobs(llm: LLM, text: str = QUALITY_TEXT) -> list[float]:
    """Teacher-forced logprob of each token of `text` after its first, in order: one request
    with `prompt_logprobs`, which scores the whole text in one prefill."""
    ids = llm.tokenizer.encode(text)
    if len(ids) < 2:
        raise ValueError("the text must tokenize to at least two tokens")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    scores = llm.generate([ids], params)[0].prompt_logprobs
    assert scores is not None
    return [scores[i][ids[i]].logprob for i in range(1, len(ids))]  # type: ignore[index]


def perplexity(llm: LLM, text: str = QUALITY_TEXT) -> float:
    """Teacher-forced perplexity of `text` (every token after the first is scored)."""
    return perplexity_from_logprobs(token_logprobs(llm, text))
