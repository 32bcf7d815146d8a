"""A hostile schema never stalls the engine: oversized ones are refused on submission within a
couple of seconds, and a costly one within the limits is analysed off the engine thread while
other requests keep getting tokens."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams, StructuredOutputs
from loraplex.grammar.errors import SchemaTooLargeError, UnsupportedSchemaError

sys.path.insert(0, str(Path(__file__).parents[2] / "grammar"))
from hostile_schemas import nested, wide  # noqa: E402


def _params(schema: dict) -> SamplingParams:
    return SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(json=schema))


def test_hostile_schemas_are_refused_while_another_request_keeps_decoding(llm: LLM) -> None:
    engine = llm.engine
    other = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("other", "Count slowly:", other)
    tokens = 0

    def step() -> None:
        nonlocal tokens
        for out in engine.step():
            if out.request_id == "other":
                tokens = len(out.outputs[0].token_ids)

    step()
    for schema, limit in ((wide(100_000), "max_schema_nodes"), (nested(150), "max_schema_depth")):
        start = time.monotonic()
        with pytest.raises(SchemaTooLargeError, match=limit):
            engine.add_request(None, "JSON:", _params(schema))
        assert time.monotonic() - start < 2.0
        before = tokens
        step()
        assert tokens > before  # the engine steps on

    # Within the limits but slow to validate (seconds of jsonschema), then refused: the engine
    # thread only checks the limits, the compile child does the rest.
    costly = wide(1_500)
    costly["properties"]["last"] = {"type": "integer", "not": {"const": 3}}  # neither backend
    start = time.monotonic()
    engine.add_request("costly", "JSON:", _params(costly))
    assert time.monotonic() - start < 1.0
    before, failed = tokens, None
    deadline = time.monotonic() + 60
    while failed is None:
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.request_id == "costly":
                failed = out
            elif out.request_id == "other":
                tokens = len(out.outputs[0].token_ids)
    assert tokens > before  # decoded while the schema was analysed
    assert failed.finished and "feature: not" in failed.error
    assert isinstance(failed.failure, UnsupportedSchemaError)
    engine.abort_request("other")
    assert not engine.has_unfinished_requests()
