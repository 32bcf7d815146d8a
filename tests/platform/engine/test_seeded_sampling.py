"""A seed gives the same tokens whatever the engine does around the request: alone or in a
batch of 64 mixed requests, preempted and recomputed, with async scheduling on or off, with
prefix caching on or off. Penalties run under async scheduling (no lock step) and give the
lock-step engine's tokens. Unseeded requests draw their seed from the engine's seeded
generator, so a fresh engine given the same requests in the same order samples the same text.
"""

from __future__ import annotations

import gc

import pytest
from engine_prompts import PROMPTS

from loraplex import LLM, SamplingParams

MIXES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=0.8, top_k=20),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.9, repetition_penalty=1.3),
    dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5),
    dict(temperature=0.0, frequency_penalty=1.0),
    dict(temperature=0.8, logprobs=3),
    dict(temperature=1.0, min_tokens=6),
]
NUM = 64
MAX_TOKENS = 8
# Half the prompts share a two-block prefix, so prefix caching has something to reuse.
SHARED = " ".join(f"word{i}" for i in range(40))


def _prompts() -> list[str]:
    return [
        f"{SHARED} {PROMPTS[i % len(PROMPTS)]}" if i % 2 else PROMPTS[i % len(PROMPTS)]
        for i in range(NUM)
    ]


def _params() -> list[SamplingParams]:
    """Request i: mix i mod 10; every third request unseeded (the engine draws its seed)."""
    return [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            seed=None if i % 3 == 2 else 1000 + i,
            **MIXES[i % len(MIXES)],
        )
        for i in range(NUM)
    ]


def _seeded(i: int) -> bool:
    return i % 3 != 2


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    """The mixed batch through the shared lock-step engine (prefix caching on)."""
    return _tokens(llm.generate(_prompts(), _params()))


def _fresh(model_dir, **options) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", **options)


def _small_set() -> tuple[list[str], list[SamplingParams]]:
    """The 8 short prompts, 24 tokens each, mixed as above: long enough that a KV pool of a
    quarter of their need preempts (as tests/platform/engine/test_kv_behaviour.py does)."""
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, seed=None if i % 3 == 2 else 77 + i,
                       **MIXES[(3 * i) % len(MIXES)])
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    return PROMPTS, params


@pytest.fixture(scope="module")
def small_reference(llm) -> list[list[int]]:
    prompts, params = _small_set()
    return _tokens(llm.generate(prompts, params))


@pytest.fixture(scope="module")
def fresh_runs(model_dir, llm, small_reference) -> dict[str, tuple[list[list[int]], int]]:
    """Fresh engines, each given its requests first: (tokens, preemptions) per engine. The
    mixed batch of 64 under async scheduling without prefix caching; the small set under a
    KV pool a quarter of its need, async with prefix caching and lock step without."""
    prompts, params = _small_set()
    needed = sum(-(-(len(llm.tokenizer.encode(p)) + 24) // 16) for p in prompts)
    tiny = max(needed // 4, 6)
    configs = {
        "async, no prefix caching": (
            dict(async_scheduling=True, enable_prefix_caching=False, num_kv_blocks=512),
            _prompts(),
            _params(),
        ),
        "async, tiny KV pool": (dict(async_scheduling=True, num_kv_blocks=tiny), prompts, params),
        "lock step, tiny KV pool, no prefix caching": (
            dict(async_scheduling=False, enable_prefix_caching=False, num_kv_blocks=tiny),
            prompts,
            params,
        ),
    }
    runs = {}
    for name, (options, run_prompts, run_params) in configs.items():
        llm = _fresh(model_dir, **options)
        tokens = _tokens(llm.generate(run_prompts, run_params))
        runs[name] = (tokens, llm.stats().num_preemptions)
        llm.engine.shutdown()
        del llm
        gc.collect()
    return runs


def test_seeded_request_alone_equals_it_in_a_mixed_batch(llm, reference):
    params = _params()
    prompts = _prompts()
    # One seeded request of each mix, alone.
    for i in [i for i in range(20) if _seeded(i)][: len(MIXES)]:
        alone = llm.generate([prompts[i]], params[i])[0].outputs[0].token_ids
        assert alone == reference[i], (i, params[i])


def test_seeded_tokens_survive_async_preemption_and_prefix_caching(
    reference, small_reference, fresh_runs
):
    seeded = [i for i in range(NUM) if _seeded(i)]
    tokens, _ = fresh_runs["async, no prefix caching"]
    assert [tokens[i] for i in seeded] == [reference[i] for i in seeded]
    small_seeded = [i for i in range(len(PROMPTS)) if _seeded(i)]
    for name in ("async, tiny KV pool", "lock step, tiny KV pool, no prefix caching"):
        tokens, preemptions = fresh_runs[name]
        assert [tokens[i] for i in small_seeded] == [small_reference[i] for i in small_seeded]
        assert preemptions > 0, name


def test_unseeded_requests_reproducible_from_the_engine_seed(fresh_runs, small_reference):
    # Two fresh engines (model.seed 0) given the same requests in the same order draw the same
    # seeds for the unseeded ones, whatever their scheduling and preemptions.
    a, _ = fresh_runs["async, tiny KV pool"]
    b, _ = fresh_runs["lock step, tiny KV pool, no prefix caching"]
    assert a == b
    _, params = _small_set()
    unseeded = [i for i, p in enumerate(params) if p.seed is None and not p.greedy]
    assert unseeded
    # The shared engine had drawn other seeds before: its unseeded samples differ.
    assert [a[i] for i in unseeded] != [small_reference[i] for i in unseeded]


def test_different_seeds_give_different_text(llm):
    outs = llm.generate(
        [PROMPTS[4]] * 6,
        [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True) for s in range(6)],
    )
    assert len({tuple(t) for t in _tokens(outs)}) >= 5


@pytest.fixture(scope="module")
def async_llm(model_dir) -> LLM:
    llm = _fresh(model_dir, async_scheduling=True, num_kv_blocks=512)
    yield llm
    llm.engine.shutdown()


def test_penalties_run_ahead_without_lock_step(llm, async_llm, monkeypatch):
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=5,
                       presence_penalty=1.0, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, min_tokens=10,
                       logprobs=2),
    ]  # fmt: skip
    prompts = ["one two one two one two one two", PROMPTS[4], PROMPTS[0]]
    expected = llm.generate(prompts, params)
    engine = async_llm.engine
    step = engine.step
    seen = {"lock_step": 0, "in_flight": 0}

    def checked_step():
        outputs = step()
        seen["lock_step"] += engine.scheduler.num_lock_step
        seen["in_flight"] += engine._in_flight is not None
        return outputs

    monkeypatch.setattr(engine, "step", checked_step)
    got = async_llm.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert seen["lock_step"] == 0
    assert seen["in_flight"] >= 15  # most steps launched before the last one's tokens were read
    # The penalties had an effect: without them the repeater repeats more.
    plain = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=20,
                                                      ignore_eos=True))  # fmt: skip
    assert _tokens(got)[0] != _tokens(plain)[0]
    lp_got, lp_expected = got[2].outputs[0].logprobs, expected[2].outputs[0].logprobs
    assert [sorted(e) for e in lp_got] == [sorted(e) for e in lp_expected]
