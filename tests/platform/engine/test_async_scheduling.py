"""Async scheduling (step N+1 launched before step N's tokens are read) changes no output.

On CPU the device work is done when a step returns, but the engine's order of events is the
one a GPU sees: schedule N+1, launch it with the inputs step N left on the device, then
process step N's tokens. Every output must equal the lock-step engine's, token for token.
"""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS

from loraplex import LLM, SamplingParams, StructuredOutputs


@pytest.fixture(scope="module")
def async_llm(model_dir) -> LLM:
    llm = LLM(
        str(model_dir), dtype="float32", num_kv_blocks=512, device="cpu", async_scheduling=True
    )
    assert llm.engine.async_scheduling
    return llm


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _finish(outputs) -> list[list[str | None]]:
    return [[c.finish_reason for c in o.outputs] for o in outputs]


def _count_overlapped_steps(llm: LLM, monkeypatch) -> list[int]:
    """Counts (in a one-item list) the steps launched with inputs still on the device."""
    runner, count = llm.engine.runner, [0]
    prepare = runner.prepare

    def counting(*args, **kwargs):
        batch = prepare(*args, **kwargs)
        count[0] += len(batch.pending_tokens) > 0
        return batch

    monkeypatch.setattr(runner, "prepare", counting)
    return count


def _assert_all_freed(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert not llm.engine.has_unfinished_requests()


def test_greedy_outputs_and_stops_equal_lock_step(llm, async_llm, monkeypatch):
    # Mixed lengths, EOS allowed: requests end on different steps, some by EOS, some by length.
    params = [
        SamplingParams(temperature=0.0, max_tokens=4 + 7 * i, stop=["\n\n"] if i % 3 == 0 else [])
        for i in range(len(PROMPTS))
    ]
    expected = llm.generate(PROMPTS, params)
    overlapped = _count_overlapped_steps(async_llm, monkeypatch)
    got = async_llm.generate(PROMPTS, params)
    assert _tokens(got) == _tokens(expected)
    assert _finish(got) == _finish(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert overlapped[0] >= 20  # most decode steps really took their input from the device
    _assert_all_freed(async_llm)


def test_seeded_sampling_min_tokens_logprobs_and_n_equal_lock_step(llm, async_llm):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=10, logprobs=2),
        SamplingParams(temperature=0.7, seed=3, n=3, max_tokens=9),
    ]
    prompts = PROMPTS[:3]
    expected = llm.generate(prompts, params)
    got = async_llm.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    lp_expected = expected[1].outputs[0].logprobs
    lp_got = got[1].outputs[0].logprobs
    assert [sorted(e) for e in lp_got] == [sorted(e) for e in lp_expected]
    _assert_all_freed(async_llm)


def test_preemption_under_a_small_kv_budget(llm, model_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = llm.generate(PROMPTS, greedy)
    needed = sum(-(-(len(o.prompt_token_ids) + 24) // 16) for o in expected)
    small = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        num_kv_blocks=max(needed // 4, 6),
        async_scheduling=True,
    )
    got = small.generate(PROMPTS, greedy)
    assert _tokens(got) == _tokens(expected)
    assert small.stats().num_preemptions > 0
    _assert_all_freed(small)


def test_grammar_runs_ahead_alongside_penalties(llm, async_llm, monkeypatch):
    # NOTE: penalties read device state only and run ahead (test_seeded_sampling); a grammar's
    # mask is filled on the host after the previous step's tokens are read, while the next
    # step's forward pass runs, so it runs ahead too (test_grammar_overlap).
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3),
        SamplingParams(
            temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputs(json=schema)
        ),
    ]
    prompts = PROMPTS[:2] + ["Give a JSON object with a number n:"]
    for engine in (llm.engine, async_llm.engine):  # compiled: no cold start (its timing varies)
        engine.structured.compiler.compile(params[2].structured_outputs, timeout=120)
    expected = llm.generate(prompts, params)
    ahead_with_grammar = []
    engine = async_llm.engine
    step = engine.step

    def checked_step():
        outputs = step()
        assert not engine.scheduler.num_lock_step
        ahead_with_grammar.append(engine._in_flight is not None and engine.structured.num_active)
        return outputs

    monkeypatch.setattr(engine, "step", checked_step)
    got = async_llm.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert sum(map(bool, ahead_with_grammar)) >= 5
    _assert_all_freed(async_llm)


def test_prefix_cache_hits_and_abort(async_llm):
    prefix = async_llm.tokenizer.encode(" ".join(f"item{i}" for i in range(120)))[:160]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    first = async_llm.generate([prefix + [11, 12, 13]], greedy)[0]
    second = async_llm.generate([prefix + [11, 12, 13]], greedy)[0]
    assert second.num_cached_tokens >= 144
    assert second.outputs[0].token_ids == first.outputs[0].token_ids

    engine = async_llm.engine
    engine.add_request("keep", PROMPTS[0], greedy)
    engine.add_request("drop", PROMPTS[1], greedy)
    for _ in range(4):
        engine.step()
    aborted = engine.abort_request("drop")
    assert aborted is not None and aborted.finished
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "keep"
            if out.finished:
                done[out.request_id] = out
    assert len(done["keep"].outputs[0].token_ids) == 20
    _assert_all_freed(async_llm)
