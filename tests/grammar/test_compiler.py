"""Background compilation: non-blocking, deduplicated, cached on disk, and bounded in time and
memory without harming the server."""

from __future__ import annotations

import pytest

from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.errors import (
    GrammarCompileError,
    GrammarMemoryError,
    GrammarTimeoutError,
    UnsupportedSchemaError,
)
from loraplex.grammar.matcher import GrammarMatcher
from loraplex.platform.core.structured_outputs import StructuredOutputs


def _long_string(max_length: int) -> StructuredOutputs:
    return StructuredOutputs(
        json={
            "type": "object",
            "required": ["s"],
            "properties": {"s": {"type": "string", "maxLength": max_length}},
        }
    )


@pytest.fixture
def fresh(vocabulary, tmp_path):
    """A compiler with its own empty disk cache and tight limits."""
    compiler = GrammarCompiler(
        vocabulary, GrammarConfig(compile_timeout_s=1.5, compile_memory_mib=350, cache_dir=tmp_path)
    )
    yield compiler
    compiler.shutdown()


@pytest.fixture
def outlines_only(vocabulary, tmp_path):
    """`fresh`'s limits with outlines-core as the only JSON backend (nothing to fall back on)."""
    config = GrammarConfig(
        compile_timeout_s=1.5,
        compile_memory_mib=350,
        cache_dir=tmp_path,
        json_backends=("outlines",),
    )
    compiler = GrammarCompiler(vocabulary, config)
    yield compiler
    compiler.shutdown()


def test_slow_schema_times_out_without_blocking_or_harming_others(outlines_only) -> None:
    fresh = outlines_only
    future = fresh.submit(_long_string(2000))
    assert not future.done()  # the caller keeps going while it compiles
    assert fresh.submit(_long_string(2000)) is future  # one compile per spec in flight
    with pytest.raises(GrammarTimeoutError, match="1.5 s"):
        future.result(timeout=30)
    grammar = fresh.compile(StructuredOutputs(regex="[a-c]{2}"), timeout=30)
    assert GrammarMatcher(grammar).accept_token(
        grammar.index.get_allowed_tokens(grammar.initial_state)[0]
    )
    again = fresh.submit(_long_string(2000))
    assert again.done() and isinstance(again.exception(), GrammarTimeoutError)


def test_schema_over_the_memory_limit_fails_cleanly(vocabulary, tmp_path) -> None:
    compiler = GrammarCompiler(
        vocabulary,
        GrammarConfig(
            compile_timeout_s=60,
            compile_memory_mib=256,
            cache_dir=tmp_path,
            json_backends=("outlines",),  # llguidance would serve it after the failure
        ),
    )
    try:
        with pytest.raises(GrammarMemoryError, match="256 MiB"):
            compiler.compile(_long_string(400), timeout=90)
        assert compiler.compile(StructuredOutputs(choice=["ok"]), timeout=30) is not None
    finally:
        compiler.shutdown()


def test_invalid_regex_is_a_compile_error(fresh) -> None:
    with pytest.raises(GrammarCompileError):
        fresh.compile(StructuredOutputs(regex="(unclosed"), timeout=30)


def test_unsupported_schema_is_refused_by_the_analysis_in_the_child(fresh) -> None:
    # NOTE: `not` is enforced by neither backend (outlines-core, llguidance).
    future = fresh.submit(StructuredOutputs(json={"type": "integer", "not": {"const": 3}}))
    with pytest.raises(UnsupportedSchemaError, match="feature: not") as caught:
        future.result(timeout=30)
    assert caught.value.feature == "not"
    assert fresh.num_compiles == 0
    with pytest.raises(GrammarCompileError, match="invalid JSON schema"):
        fresh.compile(StructuredOutputs(json={"type": "object", "required": 3}), timeout=30)


def test_disk_cache_survives_a_restart(vocabulary, tmp_path) -> None:
    outputs = StructuredOutputs(regex="(red|green|blue)")
    config = GrammarConfig(cache_dir=tmp_path)
    first = GrammarCompiler(vocabulary, config)
    first.compile(outputs, timeout=30)
    first.shutdown()
    assert first.num_compiles == 1 and list(tmp_path.glob("*.index"))
    second = GrammarCompiler(vocabulary, config)
    try:
        grammar = second.compile(outputs, timeout=30)
        assert second.num_compiles == 0 and second.cache.disk_hits == 1
        assert grammar.allowed_token_ids(grammar.initial_state)
    finally:
        second.shutdown()


def test_corrupt_cache_file_is_recompiled(vocabulary, tmp_path) -> None:
    outputs = StructuredOutputs(regex="x+")
    compiler = GrammarCompiler(vocabulary, GrammarConfig(cache_dir=tmp_path))
    key = compiler.check(outputs).key(vocabulary.fingerprint)
    (tmp_path / f"{key}.index").write_bytes(b"not an index")
    try:
        grammar = compiler.compile(outputs, timeout=30)
        assert compiler.num_compiles == 1
        assert grammar.allowed_token_ids(grammar.initial_state)
    finally:
        compiler.shutdown()


def test_a_child_that_dies_puts_its_last_stderr_lines_in_the_error(
    vocabulary, tmp_path, monkeypatch
) -> None:
    from loraplex.grammar import worker

    script = tmp_path / "broken_child.py"
    script.write_text(
        "import sys\n"
        "print('starting', file=sys.stderr)\n"
        "print('ModuleNotFoundError: No module named outlines_core', file=sys.stderr)\n"
        "sys.exit(1)\n"
    )
    monkeypatch.setattr(worker, "_CHILD", script)
    compiler = GrammarCompiler(vocabulary, GrammarConfig(cache_dir=tmp_path / "cache"))
    try:
        with pytest.raises(GrammarCompileError, match="No module named outlines_core"):
            compiler.compile(StructuredOutputs(regex="[0-9]{2}"))
    finally:
        compiler.shutdown()


def test_the_child_is_given_the_parents_sys_path(tmp_path, monkeypatch) -> None:
    # A package reachable only through the parent's sys.path (e.g. PYTHONPATH) must import in
    # the child, which runs isolated (-I) and adds these paths behind its own.
    import json

    from loraplex.grammar.worker import child_command

    extra = tmp_path / "only_on_parent_path"
    extra.mkdir()
    monkeypatch.syspath_prepend(str(extra))
    command = child_command(512)
    assert command[1] == "-I"
    assert str(extra) in json.loads(command[-1])


def test_a_schema_outlines_cannot_build_in_time_is_served_by_llguidance(fresh) -> None:
    # outlines-core builds this maxLength-2000 automaton for longer than the 1.5 s limit (the
    # test above); the child is killed before it reaches the next backend, so the compiler
    # retries once with the others, and llguidance parses it lazily.
    grammar = fresh.compile(_long_string(2000), timeout=60)
    assert grammar.backend == "llguidance"
    assert fresh.submit(_long_string(2000)).result() is grammar  # remembered, not retried
