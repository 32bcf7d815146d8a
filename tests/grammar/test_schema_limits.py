"""Schema size limits: a huge or deeply nested schema is refused at once, naming the limit, and
never reaches anything recursive; what passes is analysed in the compile child, off the caller's
thread and under the compile time limit."""

from __future__ import annotations

import time

import pytest
from hostile_schemas import nested, wide

from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.errors import GrammarError, GrammarTimeoutError, SchemaTooLargeError
from loraplex.grammar.schema_limits import check_schema_limits
from loraplex.platform.core.structured_outputs import StructuredOutputs


@pytest.fixture(scope="module")
def compiler(vocabulary, tmp_path_factory):
    compiler = GrammarCompiler(
        vocabulary,
        GrammarConfig(compile_timeout_s=1.5, cache_dir=tmp_path_factory.mktemp("grammars")),
    )
    yield compiler
    compiler.shutdown()


@pytest.mark.parametrize(
    ("schema", "limit"),
    [
        (wide(100_000), "max_schema_nodes"),
        (nested(150), "max_schema_depth"),
        (nested(5_000), "max_schema_depth"),  # past Python's recursion limit: no RecursionError
        ({"type": "string", "description": "x" * 600_000}, "max_schema_bytes"),
    ],
    ids=["100k-properties", "150-levels", "5000-levels", "600-KB"],
)
def test_an_oversized_schema_is_refused_at_once_naming_the_limit(compiler, schema, limit):
    start = time.monotonic()
    with pytest.raises(SchemaTooLargeError, match=limit) as caught:
        compiler.submit(StructuredOutputs(json=schema))
    assert time.monotonic() - start < 2.0
    assert caught.value.limit == limit
    assert isinstance(caught.value, GrammarError) and isinstance(caught.value, ValueError)
    assert compiler.num_compiles == 0


def test_limits_count_what_they_say():
    config = GrammarConfig(max_schema_depth=3, max_schema_nodes=5, max_schema_bytes=40)
    check_schema_limits({"a": {"b": [1]}}, config)  # 3 containers deep, 4 values, 17 bytes
    with pytest.raises(SchemaTooLargeError, match="max_schema_depth"):
        check_schema_limits({"a": {"b": [[1]]}}, config)
    with pytest.raises(SchemaTooLargeError, match="max_schema_nodes"):
        check_schema_limits({"a": [1, 2, 3, 4, 5]}, config)
    with pytest.raises(SchemaTooLargeError, match="max_schema_bytes"):
        check_schema_limits({"description": "é" * 20}, config)  # 41 bytes in UTF-8
    for name in ("max_schema_depth", "max_schema_nodes", "max_schema_bytes"):
        with pytest.raises(ValueError, match=name):
            GrammarConfig(**{name: 0})


def test_a_schema_within_the_limits_still_compiles(compiler):
    grammar = compiler.compile(StructuredOutputs(json=nested(3)), timeout=60)
    assert grammar.allowed_token_ids(grammar.initial_state)


def test_a_costly_schema_within_the_limits_is_analysed_in_the_child_under_its_time_limit(
    vocabulary, tmp_path
):
    # About 4,000 values: outlines-core's analysis (jsonschema's validation alone) takes
    # seconds here. Only outlines-core: llguidance, tried after a timeout, parses it quickly.
    config = GrammarConfig(compile_timeout_s=1.5, cache_dir=tmp_path, json_backends=("outlines",))
    compiler = GrammarCompiler(vocabulary, config)
    try:
        start = time.monotonic()
        future = compiler.submit(StructuredOutputs(json=wide(2_000)))
        assert time.monotonic() - start < 0.5  # the caller's thread only checked the limits
        with pytest.raises(GrammarTimeoutError, match="1.5 s"):
            future.result(timeout=60)
    finally:
        compiler.shutdown()
