"""Cold starts in the engine: a request with a JSON schema never seen before starts decoding
under an llguidance grammar while outlines-core compiles, hands over to the outlines-core
grammar mid-output once it is ready, and its output validates; later requests with the schema
start on the compiled grammar. A hand-over the compiled grammar refuses keeps the first."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from loraplex import SamplingParams, StructuredOutputs
from loraplex.config import EngineConfig
from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.platform.core.request import Request
from loraplex.platform.engine.engine import Engine
from loraplex.platform.engine.structured_output import GrammarJob, StructuredOutputManager

sys.path.insert(0, str(Path(__file__).parents[2] / "grammar"))
from compile_gate import hold_outlines  # noqa: E402

pytest.importorskip("llguidance", reason="cold starts use the llguidance backend")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture
def engine(model_dir, tmp_path):
    config = EngineConfig.from_options(
        model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=128, max_num_seqs=8,
        enable_lora=False, async_scheduling=True, seed=0, cache_dir=tmp_path,
    )  # fmt: skip
    engine = Engine(config)
    yield engine
    engine.shutdown()


def _backend(engine: Engine, request_id: str) -> str | None:
    request = engine.scheduler.requests.get(request_id)
    return None if request is None or request.grammar is None else request.grammar.grammar.backend


def _step_until(engine: Engine, done, timeout_s: float = 120) -> list:
    outputs, deadline = [], time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        outputs += engine.step()
    return outputs


def test_a_cold_schema_starts_under_llguidance_and_hands_over(engine, monkeypatch):
    gate = hold_outlines(engine.structured.compiler, monkeypatch)
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=64, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    engine.add_request("cold", "A person as JSON:", params)
    text: list[int] = []

    def some_tokens() -> bool:
        request = engine.scheduler.requests["cold"]
        text[:] = request.output_token_ids
        return len(text) >= 4

    _step_until(engine, some_tokens)  # decoding while outlines-core has not compiled
    assert _backend(engine, "cold") == "llguidance"
    assert engine.structured.cold_start_stats.started == 1
    assert engine.scheduler.num_lock_step == 0
    gate.set()
    handed = []

    def finished() -> bool:
        handed.append(_backend(engine, "cold"))
        return not engine.has_unfinished_requests()

    outputs = _step_until(engine, finished)
    final = [o for o in outputs if o.request_id == "cold" and o.finished][0].outputs[0]
    assert "outlines" in handed
    assert engine.structured.cold_start_stats.handed_over == 1
    if final.finish_reason == "stop":
        assert not list(Draft202012Validator(SCHEMA).iter_errors(json.loads(final.text)))
    assert final.token_ids[:4] == text[:4]  # the tokens before the hand-over were kept

    # The same schema again: compiled, so no cold start; it starts on outlines-core.
    engine.add_request("warm", "Another person:", params)
    _step_until(engine, lambda: bool(engine.scheduler.requests["warm"].output_token_ids))
    assert _backend(engine, "warm") == "outlines"
    assert engine.structured.cold_start_stats.started == 1
    _step_until(engine, lambda: not engine.has_unfinished_requests())
    assert engine.structured.num_active == 0


@pytest.fixture(scope="module")
def grammars(model_dir, tmp_path_factory):
    """(outlines-core grammar, llguidance grammar) of a schema with a number and a string."""
    from tokenizers import Tokenizer

    from loraplex.grammar.vocabulary import build_vocabulary

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stops = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    vocabulary = build_vocabulary(tokenizer, stops)
    schema = {
        "type": "object",
        "properties": {"x": {"type": "number"}, "s": {"type": "string"}},
        "required": ["x", "s"],
    }
    found = []
    for backend in ("outlines", "llguidance"):
        config = GrammarConfig(
            json_backends=(backend,), cache_dir=tmp_path_factory.mktemp(backend), cold_start=False
        )
        compiler = GrammarCompiler(vocabulary, config)
        found.append(compiler.compile(StructuredOutputs(json=schema), timeout=120))
        compiler.shutdown()
    return tokenizer, *found


def _started(manager: StructuredOutputManager, grammars, text: str) -> tuple[Request, Future]:
    """A request that started under the llguidance grammar and generated `text`; the future
    its outlines-core grammar will come in."""
    tokenizer, _, cold = grammars
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=64), (0,), max_tokens=64)
    exact: Future = Future()
    ready: Future = Future()
    ready.set_result(cold)
    manager.add_request(request, GrammarJob(exact, ready))
    assert manager.poll() == []
    assert request.grammar.grammar is cold
    for token in tokenizer.encode(text).ids:
        assert request.grammar.accept_token(token)
        request.append_output_token(token)
    return request, exact


def _fill(manager: StructuredOutputManager, request: Request) -> None:
    manager.fill_bitmask([request], np.array([0], dtype=np.int64))


@pytest.mark.parametrize(
    ("text", "handed_over"),
    [
        ('{"x": 1.5, "s": "a', True),
        ('{"x": 2E3', False),  # llguidance takes a capital exponent; outlines-core does not
    ],
)
def test_hand_over_replays_the_output_or_keeps_the_cold_grammar(grammars, text, handed_over):
    _, exact_grammar, cold = grammars
    manager = StructuredOutputManager(None, (0,), exact_grammar.vocab_size, 4)
    request, exact = _started(manager, grammars, text)
    _fill(manager, request)  # not compiled yet: still under llguidance
    assert request.grammar.grammar is cold
    exact.set_result(exact_grammar)
    _fill(manager, request)
    stats = manager.cold_start_stats
    assert (stats.started, stats.handed_over, stats.refused) == (1, handed_over, not handed_over)
    assert request.grammar.grammar is (exact_grammar if handed_over else cold)
    if handed_over:  # the new matcher stands where the old one stood
        tokenizer = grammars[0]
        assert request.grammar.accept_tokens(tokenizer.encode('bc", ').ids) is False
        assert request.grammar.accept_tokens(tokenizer.encode('bc"}').ids)
        assert request.grammar.is_final()


def test_a_failed_compile_keeps_the_cold_grammar(grammars):
    _, exact_grammar, cold = grammars
    manager = StructuredOutputManager(None, (0,), exact_grammar.vocab_size, 4)
    request, exact = _started(manager, grammars, '{"x": 1')
    exact.set_exception(TimeoutError("too slow"))
    _fill(manager, request)
    assert request.grammar.grammar is cold
    assert manager.cold_start_stats.handed_over == 0
    manager.forget("r")
    assert manager.num_active == 0


def test_an_engine_waiting_only_for_grammars_sleeps_instead_of_spinning(
    engine, monkeypatch, tmp_path
):
    engine.structured.reconfigure(GrammarConfig(cold_start=False, cache_dir=tmp_path / "off"))
    gate = hold_outlines(engine.structured.compiler, monkeypatch)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json=SCHEMA))
    engine.add_request("waits", "A person as JSON:", params)
    steps, start = 0, time.monotonic()
    while time.monotonic() - start < 0.5:
        engine.step()
        steps += 1
    # Each empty step waited (up to 10 ms) for the compile: tens of steps, not thousands.
    assert steps <= 60, steps
    gate.set()
    _step_until(engine, lambda: not engine.has_unfinished_requests())


def test_a_server_builds_the_grammar_compiler_before_its_first_request(engine, monkeypatch):
    """`prepare` (run when a server starts) builds the vocabulary on its own thread, so the
    first JSON-schema request neither builds it again nor waits on the engine thread."""
    import threading

    import loraplex.grammar.vocabulary as vocabulary

    built_on: list[str] = []
    real = vocabulary.build_vocabulary

    def build(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(vocabulary, "build_vocabulary", build)
    engine.structured.prepare().join(120)
    assert built_on == ["grammar-prepare"]
    assert engine.structured.compiler.wait_warm(120)
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=24, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    engine.add_request("first", "A person as JSON:", params)
    outputs = _step_until(engine, lambda: not engine.scheduler.requests)
    assert built_on == ["grammar-prepare"]  # not again for the request
    [final] = [o for o in outputs if o.request_id == "first" and o.finished]
    assert final.outputs[0].finish_reason in ("stop", "length")


def test_a_shutdown_during_prepare_leaves_no_compiler(engine, monkeypatch):
    import threading

    import loraplex.grammar.vocabulary as vocabulary

    real = vocabulary.build_vocabulary
    building, shutdown_asked = threading.Event(), threading.Event()

    def gated_build(*args, **kwargs):
        building.set()
        assert shutdown_asked.wait(60)  # NOTE: the build goes on once the shutdown is asked for
        return real(*args, **kwargs)

    monkeypatch.setattr(vocabulary, "build_vocabulary", gated_build)
    thread = engine.structured.prepare()
    assert building.wait(60)
    shutdown_asked.set()
    engine.structured.shutdown()
    thread.join(120)
    assert not thread.is_alive()
    assert engine.structured._compiler is None  # no compile children left behind
    with pytest.raises(RuntimeError, match="shut down"):
        _ = engine.structured.compiler
