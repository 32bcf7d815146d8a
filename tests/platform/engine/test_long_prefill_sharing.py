"""A long prompt's chunked prefill shares each step: a short request added behind it finishes in a
bounded number of steps, and the long one still produces what it produces alone."""

from __future__ import annotations

import pytest
from engine_configs import cpu_engine_config

from loraplex import SamplingParams
from loraplex.platform.engine.engine import Engine

# Small sizes keep it to a few seconds on CPU: the prompt is 8x the step's token budget.
BUDGET = 16
LONG_PROMPT = 128
# The short request is admitted the step after it is added and samples in that step (its
# prompt fits the reserve); one more step covers a lock-step or async hand-over.
MAX_STEPS_FOR_SHORT = 3


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = Engine(
        cpu_engine_config(
            model_dir,
            num_kv_blocks=32,
            max_model_len=160,
            enable_prefix_caching=False,
            max_num_batched_tokens=BUDGET,
        )
    )
    yield engine
    engine.shutdown()


def _long_prompt(engine: Engine) -> list[int]:
    ids = engine.tokenize("The history of the city begins with a small river crossing. " * 20)
    return ids[:LONG_PROMPT]


def test_a_short_request_is_not_starved_by_a_long_prefill(engine):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = _long_prompt(engine)
    engine.add_request("alone", None, greedy, prompt_token_ids=prompt)
    alone = engine.generate_blocking(deadline_s=120)[0].outputs[0].token_ids

    engine.add_request("long", None, greedy, prompt_token_ids=prompt)
    for _ in range(3):
        assert not [o for o in engine.step() if o.finished]
    engine.add_request("short", "Hi", SamplingParams(temperature=0, max_tokens=1))
    finished: dict[str, list[int]] = {}
    steps = 0
    while "short" not in finished:
        steps += 1
        assert steps <= MAX_STEPS_FOR_SHORT, "the short request is starved by the long prefill"
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    assert "long" not in finished  # it was still prefilling: the short one did not wait for it
    finished |= {o.request_id: o.outputs[0].token_ids for o in engine.generate_blocking(120)}
    assert finished["long"] == alone
    assert len(finished["short"]) == 1
