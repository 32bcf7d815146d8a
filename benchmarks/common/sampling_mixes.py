"""The sampling mixes every benchmark reports beside greedy (no heavy imports: the serving
benchmark's client process reads them too)."""

from __future__ import annotations

# name -> SamplingParams fields; "seed" True means a seed per request (its index).
MIXES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "t1": dict(temperature=1.0, top_p=1.0),
    "t07_top_p09": dict(temperature=0.7, top_p=0.9),
    "t07_seed": dict(temperature=0.7, seed=True),
    "t07_top_k50": dict(temperature=0.7, top_k=50),
    "min_p005": dict(temperature=1.0, min_p=0.05),
    "rep11": dict(temperature=1.0, repetition_penalty=1.1),
    "presence_frequency": dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5),
    "logprobs5": dict(temperature=1.0, logprobs=5),
}
# "mixed": one batch as a multi-tenant server sees it, request i taking the (i mod 9)-th mix
# above (greedy included); its throughput only (batch 1 has no mix).
MIXED = "mixed"
# "greedy_t1": half the batch greedy, half at temperature 1.0 (request i greedy when i is even),
# the split that costs a CPU step both samplers' work.
GREEDY_T1 = "greedy_t1"
_COMBINED = {MIXED: list(MIXES), GREEDY_T1: ["greedy", "t1"]}


def mix_fields(mix: str, i: int) -> dict:
    """The sampling fields of request i under `mix` (MIXES' names, MIXED or GREEDY_T1): the same
    names in SamplingParams and in the OpenAI request body (extensions such as top_k included)."""
    if mix not in _COMBINED and mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose from {[*MIXES, *_COMBINED]}")
    names = _COMBINED.get(mix, [mix])
    fields = dict(MIXES[names[i % len(names)]])
    if fields.pop("seed", False):
        fields["seed"] = i
    return fields


# SamplingParams fields of the GPU benchmarks' fixed-length runs: greedy, and what the `openai`
# SDK sends by default (every benchmark records it beside greedy).
GREEDY = {**MIXES["greedy"], "ignore_eos": True}
T1 = {**MIXES["t1"], "ignore_eos": True}
