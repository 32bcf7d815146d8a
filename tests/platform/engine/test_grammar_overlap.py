"""Grammar requests under async scheduling: step N+1's masks are filled on the host after
step N's tokens are read, while the device runs step N+1's forward pass (no lock step).

Outputs must equal the lock-step engine's token for token (seeded sampling), validate, leave
unconstrained neighbours unchanged, and survive preemption and abort with no stale matcher.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from loraplex import LLM, SamplingParams, StructuredOutputs

sys.path.insert(0, str(Path(__file__).parents[2] / "grammar"))
from grammar_schemas import SCHEMAS  # noqa: E402

_SCHEMA_NAMES = [
    "flat_object", "optional_fields", "nested_object", "array_of_ints", "bounded_array",
    "string_enum", "mixed_enum", "const", "enum_in_object", "int_range_small",
    "int_range_wide", "number_range", "string_lengths", "pattern_full", "pattern_alternation",
    "format_date", "format_uuid", "ref_defs", "any_of", "nullable",
]  # fmt: skip
_REGEXES = [
    r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[a-z]{2,6}", r"#[0-9a-f]{6}", r"[A-Z][a-z]+ [A-Z][a-z]+",
    r"v[0-9]\.[0-9]{1,2}", r"(true|false)", r"[0-9]+(\.[0-9]+)?", r"\([a-z]+\)", r"x{2,4}y",
]  # fmt: skip
_CHOICES = [("red", "green", "blue"), ("cat", "dog"), ("north", "south", "east", "west")]


def _llm(model_dir: Path, num_kv_blocks: int = 512, **options: object) -> LLM:
    # NOTE: no cold starts: these tests compare seeded tokens across engines, and a request
    # that starts under llguidance hands over whenever outlines-core finishes compiling
    # (test_grammar_cold_start).
    return LLM(
        str(model_dir),
        grammar_cold_start=False,
        dtype="float32",
        num_kv_blocks=num_kv_blocks,
        device="cpu",
        enable_lora=False,
        max_num_seqs=48,
        seed=0,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def overlap_llm(model_dir) -> LLM:
    llm = _llm(model_dir, async_scheduling=True)
    assert llm.engine.async_scheduling and llm.engine.config.grammar.overlap
    return llm


@pytest.fixture(scope="module")
def lock_step_llm(model_dir) -> LLM:
    """Async scheduling on, grammar overlap off: the engine locks while a grammar runs."""
    return _llm(model_dir, async_scheduling=True, grammar_overlap=False)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _mixed_batch() -> tuple[list[str], list[SamplingParams], list[object]]:
    """Prompts, params and what each output must match: a schema dict, a compiled regex, a
    choice tuple, or None (unconstrained)."""
    prompts, params, checks = [], [], []

    def add(prompt: str, spec: StructuredOutputs | None, check: object, i: int) -> None:
        prompts.append(prompt)
        params.append(
            SamplingParams(temperature=1.0, seed=100 + i, max_tokens=32, structured_outputs=spec)
        )
        checks.append(check)

    for name in _SCHEMA_NAMES:
        schema = SCHEMAS[name]
        add(f"JSON for {json.dumps(schema)}:", StructuredOutputs(json=schema), schema, len(checks))
    for regex in _REGEXES:
        add(f"Text like {regex}:", StructuredOutputs(regex=regex), re.compile(regex), len(checks))
    for choice in _CHOICES:
        add(f"Pick one of {choice}:", StructuredOutputs(choice=choice), choice, len(checks))
    for text in ("Name a fruit.", "Count to five.", "Say hello.", "Describe the sea."):
        add(text, None, None, len(checks))
    return prompts, params, checks


def _assert_valid(outputs, checks) -> None:
    for output, check in zip(outputs, checks, strict=True):
        sample = output.outputs[0]
        if check is None or sample.finish_reason == "length":
            continue
        assert sample.finish_reason == "stop", sample
        if isinstance(check, dict):
            errors = list(Draft202012Validator(check).iter_errors(json.loads(sample.text)))
            assert not errors, (sample.text, errors[0].message)
        elif isinstance(check, tuple):
            assert sample.text in check
        else:
            assert check.fullmatch(sample.text), (check.pattern, sample.text)


def _assert_no_stale_matchers(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.structured.active_requests() == []
    assert engine.structured.num_active == 0


@pytest.mark.slow
def test_mixed_batch_overlaps_and_matches_lock_step(overlap_llm, lock_step_llm, monkeypatch):
    # 20 schemas, 10 regexes, 3 choice lists and 4 unconstrained requests in one batch.
    prompts, params, checks = _mixed_batch()
    for llm in (overlap_llm, lock_step_llm):  # compile once, outside the comparison
        llm.generate(prompts, [replace(p, max_tokens=1) for p in params])
    locked_engine, locked = lock_step_llm.engine, []
    locked_step = locked_engine.step

    def locking():
        outputs = locked_step()
        locked.append(bool(locked_engine.scheduler.num_lock_step))
        return outputs

    monkeypatch.setattr(locked_engine, "step", locking)
    expected = lock_step_llm.generate(prompts, params)
    assert sum(locked) >= len(locked) // 2  # overlap off: grammar requests lock the steps
    engine = overlap_llm.engine
    step, seen = engine.step, {"steps": 0, "lock_step": 0, "ahead": 0}

    def counted():
        outputs = step()
        seen["steps"] += 1
        seen["lock_step"] += bool(engine.scheduler.num_lock_step)
        seen["ahead"] += engine._in_flight is not None and engine.structured.num_active > 0
        return outputs

    monkeypatch.setattr(engine, "step", counted)
    got = overlap_llm.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    _assert_valid(got, checks)
    assert seen["lock_step"] == 0
    # Most steps launched the next one with grammar requests running, before reading tokens.
    assert seen["ahead"] >= seen["steps"] // 2
    assert engine.structured.stats.rows > 0
    # Unconstrained neighbours: the same tokens as alone (seeded noise is per request).
    alone = overlap_llm.generate(prompts[-4:], params[-4:])
    assert _tokens(alone) == _tokens(got)[-4:]
    _assert_no_stale_matchers(overlap_llm)


@pytest.mark.slow
def test_preemption_and_abort_leave_no_stale_matcher(model_dir, overlap_llm):
    prompts, params, checks = (batch[::3] for batch in _mixed_batch())
    expected = overlap_llm.generate(prompts, params)
    # A quarter of the KV blocks the batch needs (but room for its longest request), so running
    # requests are preempted and recomputed mid-output.
    need = [-(-(len(overlap_llm.tokenizer.encode(p)) + 32) // 16) for p in prompts]
    tight = _llm(model_dir, async_scheduling=True, num_kv_blocks=max(sum(need) // 4, max(need)))
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert _tokens(got) == _tokens(expected)
    _assert_valid(got, checks)
    _assert_no_stale_matchers(tight)
    tight.engine.shutdown()

    # Abort a grammar request mid-output; the same request again starts from the grammar's
    # beginning and gives the same output as the first time.
    engine = overlap_llm.engine
    engine.add_request("abort-me", prompts[0], params[0])
    for _ in range(6):
        engine.step()
    assert engine.structured.num_active == 1
    engine.abort_request("abort-me")
    while engine.has_unfinished_requests():
        engine.step()
    _assert_no_stale_matchers(overlap_llm)
    again = overlap_llm.generate(prompts[:1], params[:1])
    assert _tokens(again) == _tokens(expected)[:1]


def test_logprobs_under_a_grammar_are_of_the_masked_distribution(overlap_llm):
    # vLLM masks the logits before its sampler computes logprobs: a constrained request reports
    # the distribution it sampled from, in which forbidden tokens have probability 0.
    choice = ("yes", "no")
    params = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=4,
        logprobs=8,
        structured_outputs=StructuredOutputs(choice=choice),
    )
    out = overlap_llm.generate("Is the sky blue? Answer:", params)[0].outputs[0]
    assert out.text in choice
    tokenizer = overlap_llm.engine.tokenizer
    first = out.logprobs[0]  # token id -> Logprob, the sampled token and the top 8
    finite = {t: lp for t, lp in first.items() if math.isfinite(lp.logprob)}
    assert out.token_ids[0] in finite
    for token in finite:
        text = tokenizer.decode([token])
        assert any(c.startswith(text) for c in choice), text
    # The few allowed first tokens carry all the probability.
    assert math.isclose(sum(math.exp(lp.logprob) for lp in finite.values()), 1.0, rel_tol=1e-3)
