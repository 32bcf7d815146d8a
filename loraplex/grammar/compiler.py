"""`GrammarCompiler`: compiles structured-output specs in the background, once per spec."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

from loraplex.grammar.cache import GrammarCache
from loraplex.grammar.compile_request import CompileRequest, build_compile_request
from loraplex.grammar.compiled import CompiledGrammar
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.errors import GrammarError, GrammarMemoryError, GrammarTimeoutError
from loraplex.grammar.llguidance_backend import LLGuidanceGrammar
from loraplex.grammar.llguidance_compile import is_packed, llguidance_available
from loraplex.grammar.schema_limits import check_schema_limits
from loraplex.grammar.vocabulary import GrammarVocabulary
from loraplex.grammar.worker import CompileWorker, load_index
from loraplex.platform.core.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

# A compiled grammar of either backend: both give `new_matcher()`.
Grammar = CompiledGrammar | LLGuidanceGrammar
# Compiled grammars kept live (index loaded, state masks built) for immediate reuse.
_MAX_LIVE_GRAMMARS = 32
# Analysed specs remembered (spec key -> compile job and grammar key).
_MAX_REMEMBERED_SPECS = 1024
# Specs that failed, remembered so a client retrying one gets its error without a recompile.
_MAX_REMEMBERED_FAILURES = 256


class GrammarCompiler:
    """Turns `StructuredOutputs` into `CompiledGrammar`s off the engine loop.

    `submit` returns a `Future` at once; the engine polls `future.done()` each step and keeps
    decoding other requests meanwhile. On the caller's thread `submit` only checks a schema's
    size limits (bounded work); its analysis and the compile run in child processes
    (`num_workers` at once) under the configured time and memory limits. Equal specs share one
    compile: in flight, in memory, and on disk across restarts. A failed future raises a
    `GrammarError` (a 400). `submit_cold_start` gives a JSON schema seen for the first time an
    llguidance grammar to start under while its outlines-core grammar compiles.
    """

    def __init__(self, vocabulary: GrammarVocabulary, config: GrammarConfig | None = None) -> None:
        self.vocabulary = vocabulary
        self.config = config or GrammarConfig()
        directory = self.config.grammar_cache_dir if self.config.disk_cache else None
        self.cache = GrammarCache(self.config.memory_cache_mib * 1024 * 1024, directory)
        self._executor = ThreadPoolExecutor(self.config.num_workers, "grammar-compile")
        self._workers = self._new_workers(self.config.num_workers)
        # NOTE: cold-start grammars compile on their own thread and child, so they never queue
        # behind the slow compiles they stand in for; both start now (a child and llguidance's
        # tokenizer take about a second), off the caller's thread.
        self._cold_executor: ThreadPoolExecutor | None = None
        self._cold_workers: queue.SimpleQueue[CompileWorker] | None = None
        self._cold_warm_up: Future[None] | None = None
        if self.config.cold_start_enabled and llguidance_available():
            self._cold_executor = ThreadPoolExecutor(1, "grammar-cold-start")
            self._cold_workers = self._new_workers(1)
            self._cold_warm_up = self._cold_executor.submit(self._warm_cold_start)
        # NOTE: reentrant, because a future that is already done runs its callback at once.
        self._lock = threading.RLock()
        self._in_flight: dict[str, Future[Grammar]] = {}
        self._live: OrderedDict[str, Grammar] = OrderedDict()
        self._failures: OrderedDict[str, GrammarError] = OrderedDict()
        self._requests: OrderedDict[str, tuple[CompileRequest, str]] = OrderedDict()
        self.num_compiles = 0

    def check(self, outputs: StructuredOutputs) -> CompileRequest:
        """The compile job of `outputs`; raises `SchemaTooLargeError` for a schema over the
        size limits. Bounded work: the schema's analysis runs in the compile child."""
        return self._analyse(outputs)[0]

    def _analyse(self, outputs: StructuredOutputs) -> tuple[CompileRequest, str]:
        """The compile job and cache key of `outputs`, remembered by the spec's own key."""
        if outputs.kind == "json":
            # NOTE: first, before anything recursive (the spec's key is `json.dumps`) reads it.
            check_schema_limits(outputs.json, self.config)
        spec_key = outputs.key()
        with self._lock:
            known = self._requests.get(spec_key)
            if known is not None:
                self._requests.move_to_end(spec_key)
                return known
        request = build_compile_request(outputs, self.config)
        known = (request, request.key(self.vocabulary.fingerprint))
        with self._lock:
            self._requests[spec_key] = known
            if len(self._requests) > _MAX_REMEMBERED_SPECS:
                self._requests.popitem(last=False)
        return known

    def submit(self, outputs: StructuredOutputs) -> Future[Grammar]:
        """A future of the compiled grammar for `outputs`; done at once when cached.

        Raises `SchemaTooLargeError` right away for a schema over the size limits; every other
        refusal (`UnsupportedSchemaError`, an invalid schema or regex, a time or memory limit)
        comes from the future.
        """
        request, key = self._analyse(outputs)
        return self._submit(request, key, self._executor, self._workers)

    def submit_cold_start(self, outputs: StructuredOutputs) -> Future[Grammar] | None:
        """A future of the llguidance grammar of a JSON schema whose grammar (`submit`) is
        neither compiled nor stored yet: it compiles in milliseconds on a thread and child of
        its own, so a request can start under it while outlines-core compiles. None when the
        spec is not a JSON schema, cold starts are off (`GrammarConfig.cold_start`), or its
        grammar is live or stored (ready in milliseconds anyway)."""
        if self._cold_executor is None or outputs.kind != "json":
            return None
        request, key = self._analyse(outputs)
        if request.backends[0] == "llguidance":
            return None
        with self._lock:
            if key in self._live:
                return None
        if self.cache.has(key):
            return None
        fast = dataclasses.replace(request, backends=("llguidance",), as_outlines=True)
        assert self._cold_workers is not None
        return self._submit(
            fast, fast.key(self.vocabulary.fingerprint), self._cold_executor, self._cold_workers
        )

    def _submit(
        self,
        request: CompileRequest,
        key: str,
        executor: ThreadPoolExecutor,
        workers: queue.SimpleQueue[CompileWorker],
    ) -> Future[Grammar]:
        with self._lock:
            done = self._done_future(key)
            if done is not None:
                return done
            future = self._in_flight.get(key)
            if future is None:
                future = executor.submit(self._compile, request, key, workers)
                self._in_flight[key] = future
                future.add_done_callback(lambda _, key=key: self._finish(key))
            return future

    def compile(self, outputs: StructuredOutputs, timeout: float | None = None) -> Grammar:
        """Compile `outputs` and wait (for offline use and tests)."""
        return self.submit(outputs).result(timeout)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the cold-start child's warm-up; True when it is over (or there is none)."""
        if self._cold_warm_up is None:
            return True
        wait([self._cold_warm_up], timeout)
        return self._cold_warm_up.done()

    def shutdown(self) -> None:
        """Stop the thread pool and every compile child process."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._cold_executor is not None:
            self._cold_executor.shutdown(wait=True, cancel_futures=True)
        for workers in (self._workers, self._cold_workers):
            while workers is not None and not workers.empty():
                workers.get().close()

    def _new_workers(self, count: int) -> queue.SimpleQueue[CompileWorker]:
        workers: queue.SimpleQueue[CompileWorker] = queue.SimpleQueue()
        for _ in range(count):
            workers.put(
                CompileWorker(
                    self.vocabulary, self.config.compile_timeout_s, self.config.compile_memory_mib
                )
            )
        return workers

    def _warm_cold_start(self) -> None:
        """One cold-start compile of a tiny schema: it starts the child, loads what its first
        job imports (the schema analysis, llguidance) and builds llguidance's tokenizer here,
        so the first real request pays none of it. Neither counted nor cached; a failure
        shows again on first use."""
        assert self._cold_workers is not None
        tiny = build_compile_request(StructuredOutputs(json={"type": "boolean"}), self.config)
        tiny = dataclasses.replace(tiny, backends=("llguidance",), as_outlines=True)
        worker = self._cold_workers.get()
        try:
            self._load(worker.compile(tiny), "warm-up")
        except Exception:  # noqa: BLE001 - a warm-up only
            logger.warning("grammar cold-start warm-up failed", exc_info=True)
        finally:
            self._cold_workers.put(worker)

    def _done_future(self, key: str) -> Future[Grammar] | None:
        grammar = self._live.get(key)
        failure = self._failures.get(key)
        if grammar is None and failure is None:
            return None
        future: Future[Grammar] = Future()
        if grammar is not None:
            self._live.move_to_end(key)
            future.set_result(grammar)
        else:
            future.set_exception(failure)
        return future

    def _finish(self, key: str) -> None:
        with self._lock:
            future = self._in_flight.pop(key)
            error = future.exception() if not future.cancelled() else None
            if isinstance(error, GrammarError):
                self._failures[key] = error
                if len(self._failures) > _MAX_REMEMBERED_FAILURES:
                    self._failures.popitem(last=False)
            elif error is None and not future.cancelled():
                self._live[key] = future.result()
                if len(self._live) > _MAX_LIVE_GRAMMARS:
                    self._live.popitem(last=False)

    def _compile(
        self, request: CompileRequest, key: str, workers: queue.SimpleQueue[CompileWorker]
    ) -> Grammar:
        data = self.cache.get(key)
        if data is not None:
            try:
                return self._load(data, key)
            except Exception:  # noqa: BLE001 - a corrupt cache file is recompiled
                data = None
        try:
            data = self._run_child(request, workers)
        except (GrammarTimeoutError, GrammarMemoryError) as error:
            # NOTE: a child past its limit is killed, so the backends after the first were
            # never tried: outlines-core can take longer than the limit to build an automaton
            # that llguidance parses lazily in milliseconds. One retry with the others, under
            # the same limits (a hostile schema costs at most twice the limit, never more).
            if request.kind != "json" or len(request.backends) < 2:
                raise
            rest = dataclasses.replace(request, backends=request.backends[1:])
            logger.info("%s after %s; retrying with %s", error, request.backends[0], rest.backends)
            try:
                data = self._run_child(rest, workers)
            except GrammarError as retry_error:
                message = f"{error}; then {', '.join(rest.backends)}: {retry_error}"
                raise type(error)(message) from retry_error
        grammar = self._load(data, key)
        self.cache.put(key, data)
        return grammar

    def _run_child(
        self, request: CompileRequest, workers: queue.SimpleQueue[CompileWorker]
    ) -> bytes:
        """One compile in a child process; counted in `num_compiles` when it succeeds."""
        worker = workers.get()
        try:
            data = worker.compile(request)
        finally:
            workers.put(worker)
        with self._lock:
            self.num_compiles += 1
        return data

    def _load(self, data: bytes, key: str) -> Grammar:
        """The grammar in compiled bytes: an llguidance grammar or an outlines-core index."""
        if is_packed(data):
            return LLGuidanceGrammar(data, self.vocabulary, key)
        return CompiledGrammar(load_index(data), self.vocabulary, key)
