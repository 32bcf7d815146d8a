"""Each sampling parameter changes what the user gets, the way its name says."""

from __future__ import annotations

from collections import Counter

import pytest
from engine_prompts import PROMPTS

from loraplex import SamplingParams

STORY = PROMPTS[4]


def _one(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]


def _greedy(llm, prompt, n=24):
    return _one(llm, prompt, temperature=0.0, max_tokens=n, ignore_eos=True).token_ids


def test_greedy_gives_the_same_tokens_alone_and_in_a_batch_from_the_prefix_cache(llm):
    alone = _greedy(llm, STORY)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    crowd = llm.generate([*PROMPTS[:4], STORY], params)  # STORY's prompt is cached by now
    assert crowd[-1].outputs[0].token_ids == alone


def test_temperature_spreads_samples(llm):
    hot = llm.generate(
        [STORY], SamplingParams(temperature=1.5, n=6, max_tokens=12, seed=1, ignore_eos=True)
    )[0]
    assert len({tuple(o.token_ids) for o in hot.outputs}) >= 5
    cold = _one(llm, STORY, temperature=1e-3, max_tokens=12, seed=1, ignore_eos=True)
    assert cold.token_ids == _greedy(llm, STORY, 12)


def test_seed_reproducible_and_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([STORY], params)[0].outputs[0].token_ids
    crowd_params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 7
    crowd = llm.generate([STORY, *PROMPTS[:7]], [params, *crowd_params])
    assert crowd[0].outputs[0].token_ids == alone
    other_seed = _one(llm, STORY, temperature=1.0, max_tokens=16, seed=4321, ignore_eos=True)
    assert other_seed.token_ids != alone


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-3}, {"min_p": 1.0}])
def test_truncation_to_one_token_is_greedy(llm, kw):
    out = _one(llm, STORY, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True, **kw)
    assert out.token_ids == _greedy(llm, STORY, 16)


def test_top_k_limits_choices(llm):
    outs = llm.generate(
        [STORY], SamplingParams(temperature=2.0, top_k=2, n=8, max_tokens=1, seed=3, logprobs=2)
    )[0].outputs
    for o in outs:
        assert o.logprobs[0][o.token_ids[0]].rank <= 2


def _max_repeat(ids):
    return max(Counter(ids).values())


REPEATER = "one two one two one two one two one two one two"


@pytest.mark.parametrize(
    "kw", [{"repetition_penalty": 1.8}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}]
)
def test_penalties_reduce_repetition(llm, kw):
    plain = _one(llm, REPEATER, temperature=0.0, max_tokens=24, ignore_eos=True)
    penalised = _one(llm, REPEATER, temperature=0.0, max_tokens=24, ignore_eos=True, **kw)
    assert _max_repeat(penalised.token_ids) < _max_repeat(plain.token_ids)


def test_stop_string_cuts_text(llm):
    full = _one(llm, STORY, temperature=0.0, max_tokens=32, ignore_eos=True)
    words = full.text.split()
    stop = words[3]
    out = _one(llm, STORY, temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.text.startswith(out.text)
    kept = _one(
        llm,
        STORY,
        temperature=0.0,
        max_tokens=32,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert kept.text.endswith(stop)


def test_stop_token_ids(llm):
    full = _greedy(llm, STORY)
    target = full[5]
    out = _one(llm, STORY, temperature=0.0, max_tokens=24, stop_token_ids=[target])
    assert out.token_ids == full[: full.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_max_tokens_and_eos(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    natural = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=64))[0].outputs[0]
    assert natural.finish_reason == "stop" and len(natural.token_ids) < 64
    past = len(natural.token_ids) + 8  # past the end of speech the model chose
    ignored = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=past, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(ignored.token_ids) == past and ignored.finish_reason == "length"
    short = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
    at_least = llm.chat(
        chat, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=len(natural.token_ids) + 5)
    )[0].outputs[0]
    assert len(at_least.token_ids) >= len(natural.token_ids) + 5


def test_n_samples(llm):
    out = llm.generate(
        [STORY], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_logprobs(llm):
    out = _one(llm, STORY, temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3  # sampled token is also the top-1
        assert all(lp.logprob <= 0.0 for lp in entry.values())
        assert max(entry.values(), key=lambda lp: lp.logprob) is entry[token]
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))
    )
