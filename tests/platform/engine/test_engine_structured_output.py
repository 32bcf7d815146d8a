"""Structured output end to end through the real model and engine (offline `LLM`)."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from loraplex import LLM, SamplingParams, StructuredOutputs
from loraplex.grammar.errors import UnsupportedSchemaError

sys.path.insert(0, str(Path(__file__).parents[2] / "grammar"))
from grammar_schemas import SCHEMAS  # noqa: E402

# Generous enough for the largest schema here (arrays of objects) to complete.
MAX_TOKENS = 160


def _ask(schema: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Answer with JSON matching: {json.dumps(schema)}"}]


def _errors(schema: dict, text: str) -> list[str]:
    return [e.message for e in Draft202012Validator(schema).iter_errors(json.loads(text))]


@pytest.mark.slow
def test_every_completed_output_of_47_schemas_validates(llm: LLM) -> None:
    names = sorted(SCHEMAS)
    params = [
        SamplingParams(
            temperature=0.7,
            seed=i,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputs(json=SCHEMAS[name]),
        )
        for i, name in enumerate(names)
    ]
    outputs = llm.chat([_ask(SCHEMAS[name]) for name in names], params)
    completed = 0
    for name, output in zip(names, outputs):
        sample = output.outputs[0]
        if sample.finish_reason == "length":
            assert len(sample.token_ids) == MAX_TOKENS
            continue
        assert sample.finish_reason == "stop", name
        assert not _errors(SCHEMAS[name], sample.text), f"{name}: {sample.text!r}"
        completed += 1
    assert len(names) >= 40
    assert completed >= 0.75 * len(names), f"only {completed} of {len(names)} completed"


@pytest.mark.slow
def test_constrained_neighbours_do_not_change_unconstrained_outputs(llm: LLM) -> None:
    free = [[{"role": "user", "content": text}] for text in ("Name a fruit.", "Count to five.")]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].text for o in llm.chat(free, greedy)]
    picks = ("flat_object", "string_enum", "array_of_ints")
    constrained = [
        SamplingParams(
            temperature=0, max_tokens=48, structured_outputs=StructuredOutputs(json=SCHEMAS[n])
        )
        for n in picks
    ]
    mixed = llm.chat(
        [
            free[0],
            _ask(SCHEMAS[picks[0]]),
            free[1],
            _ask(SCHEMAS[picks[1]]),
            _ask(SCHEMAS[picks[2]]),
        ],
        [greedy, constrained[0], greedy, constrained[1], constrained[2]],
    )
    assert [mixed[0].outputs[0].text, mixed[2].outputs[0].text] == alone
    for name, output in zip(picks, (mixed[1], mixed[3], mixed[4])):
        sample = output.outputs[0]
        if sample.finish_reason == "stop":
            assert not _errors(SCHEMAS[name], sample.text), f"{name}: {sample.text!r}"
        else:
            assert sample.finish_reason == "length"


def test_second_request_with_a_schema_does_no_compile_work(llm: LLM) -> None:
    # NOTE: a fresh title makes the schema new to the disk cache too, so the first one compiles.
    schema = {
        "title": f"fresh-{uuid.uuid4().hex}",
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
    }
    params = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputs(json=schema)
    )
    compiler = llm.engine.structured.compiler
    before = compiler.num_compiles
    first = llm.generate("Is water wet? JSON:", params)
    compiler.compile(params.structured_outputs, timeout=120)  # may finish after the request
    # Its grammar, and the llguidance grammar a cold start ran the first request under.
    assert compiler.num_compiles == before + 2
    second = llm.generate("Is fire cold? JSON:", params)
    assert compiler.num_compiles == before + 2
    for output in (first, second):
        assert json.loads(output[0].outputs[0].text)["ok"] in (True, False)


def test_grammar_ends_the_request_and_max_tokens_reports_length(llm: LLM) -> None:
    choice = StructuredOutputs(choice=["alpha", "beta"])
    done = llm.generate(
        "Pick one:", SamplingParams(temperature=0, max_tokens=32, structured_outputs=choice)
    )
    assert done[0].outputs[0].text in ("alpha", "beta")
    assert done[0].outputs[0].finish_reason == "stop"
    schema = StructuredOutputs(json=SCHEMAS["flat_object"])
    cut = llm.generate(
        "JSON:", SamplingParams(temperature=0, max_tokens=2, structured_outputs=schema)
    )
    assert cut[0].outputs[0].finish_reason == "length"
    assert len(cut[0].outputs[0].token_ids) == 2


def test_unsupported_schema_is_refused_when_added(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=8,
        structured_outputs=StructuredOutputs(json={"type": "number", "not": {"const": 2}}),
    )
    with pytest.raises(UnsupportedSchemaError, match="feature: not"):
        llm.generate("x", params)
    assert not llm.engine.has_unfinished_requests()
