"""The engine's side of structured output: compile in the background, give each request a
matcher once its grammar is ready (or, for a JSON schema seen for the first time, a cold-start
llguidance grammar first, handed over to the compiled grammar mid-output), and fill a launched
step's token bitmask rows on the CPU while the device runs its forward pass."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from loraplex.platform.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from loraplex.grammar.compiler import Grammar, GrammarCompiler
    from loraplex.grammar.config import GrammarConfig
    from loraplex.platform.core.structured_outputs import StructuredOutputs
    from loraplex.platform.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepBitmask:
    """The grammar masks of one step, in host memory (pinned on CUDA) the sampler copies.

    Row i of `bitmask` masks logits row `rows[i]`; rows ascend. Valid until the next fill."""

    bitmask: torch.Tensor  # [k, words] int32
    rows: torch.Tensor  # [k] int64


@dataclass(frozen=True)
class GrammarJob:
    """The compiles a structured-output request waits on: its grammar, and for a JSON schema
    whose grammar is neither compiled nor stored, a cold-start grammar (llguidance, ready in
    milliseconds) to start under meanwhile (`GrammarCompiler.submit_cold_start`)."""

    grammar: Future[Grammar]
    cold_start: Future[Grammar] | None = None


@dataclass
class ColdStartStats:
    """Counters of requests that started under a cold-start grammar (benchmarks read them)."""

    started: int = 0  # requests that started under a cold-start grammar
    handed_over: int = 0  # of those, switched to their compiled grammar mid-output
    refused: int = 0  # of those, kept theirs: the compiled grammar refused their output so far


@dataclass
class MaskFillStats:
    """Counters of the mask fills so far (benchmarks read them)."""

    calls: int = 0  # fills with at least one constrained row
    rows: int = 0  # constrained rows filled
    reused: int = 0  # of those, rows whose slot already held the same state's mask
    seconds: float = 0.0  # host time spent filling


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_token_ids: tuple[int, ...],
        vocab_size: int,
        max_num_seqs: int,
        config: GrammarConfig | None = None,
        pin_memory: bool = False,
    ) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._vocab_size = vocab_size
        self._max_rows = max_num_seqs
        self._pin_memory = pin_memory
        self._compiler: GrammarCompiler | None = None
        # NOTE: the compiler is built on the engine thread or by `prepare`'s thread: whichever
        # comes first builds it, the other waits; `shutdown` takes it too, so a late `prepare`
        # cannot start children after it.
        self._compiler_lock = threading.Lock()
        self._shut_down = False
        self._waiting: dict[str, tuple[Request, GrammarJob]] = {}
        # Requests holding a matcher, until they finish.
        self._active: dict[str, Request] = {}
        # Requests running under a cold-start grammar: the grammar they hand over to.
        self._handovers: dict[str, Future[Grammar]] = {}
        self._bitmask: torch.Tensor | None = None  # [max_rows, words] int32
        self._bitmask_np: np.ndarray | None = None  # its numpy view
        self._rows: torch.Tensor | None = None  # [max_rows] int64
        # What each bitmask slot holds now: the grammar's mask array it was copied from
        # (`mask_row`), or None (unknown, or computed by llguidance).
        self._slot_masks: list[np.ndarray | None] = []
        self.stats = MaskFillStats()
        self.cold_start_stats = ColdStartStats()

    @property
    def compiler(self) -> GrammarCompiler:
        """Started on first use (or by `prepare`): it spawns compile worker processes."""
        with self._compiler_lock:
            if self._shut_down:
                raise RuntimeError("the structured-output manager is shut down")
            if self._compiler is None:
                from loraplex.grammar.compiler import GrammarCompiler
                from loraplex.grammar.vocabulary import build_vocabulary

                vocab = build_vocabulary(self._tokenizer.backend, self._stop_token_ids)
                self._compiler = GrammarCompiler(vocab, self._config)
            return self._compiler

    def prepare(self) -> threading.Thread:
        """Build the grammar vocabulary and start the compiler (and its cold-start child) on
        a thread now, so a server's first grammar request does not pay for them (about a
        second at a 49k vocabulary). A failure (no outlines-core, say) is logged; the first
        grammar request meets it again as its error."""

        def build() -> None:
            try:
                self.compiler  # noqa: B018 - built for its side effect
            except Exception as exc:  # noqa: BLE001 - reported again on first use
                logger.warning("structured output not prepared: %s", exc)

        thread = threading.Thread(target=build, name="grammar-prepare", daemon=True)
        thread.start()
        return thread

    @property
    def num_active(self) -> int:
        """Requests holding a matcher (some may have finished since the last fill)."""
        return len(self._active)

    def submit(self, spec: StructuredOutputs) -> GrammarJob:
        """Start (or reuse) a compile, and a cold-start one for a JSON schema whose grammar is
        not ready; raises GrammarError at once for refused specs."""
        compiler = self.compiler
        grammar = compiler.submit(spec)
        cold_start = None if grammar.done() else compiler.submit_cold_start(spec)
        return GrammarJob(grammar, cold_start)

    def add_request(self, request: Request, job: GrammarJob) -> None:
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._waiting[request.request_id] = (request, job)

    def poll(self) -> list[tuple[Request, Exception]]:
        """Hand matchers to requests whose grammar (or cold-start grammar) is ready; returns
        the failed ones. A failed cold-start compile only means waiting for the grammar."""
        if not self._waiting:
            return []
        failed = []
        for req_id, (request, job) in list(self._waiting.items()):
            handover = None
            if job.grammar.done():
                ready = job.grammar
            elif job.cold_start is not None and _succeeded(job.cold_start):
                ready, handover = job.cold_start, job.grammar
            else:
                continue
            del self._waiting[req_id]
            if request.status.finished:
                continue
            try:
                request.grammar = ready.result().new_matcher()
            except Exception as exc:  # a GrammarError from the compile
                failed.append((request, exc))
                continue
            self._active[req_id] = request
            if handover is not None:
                self._handovers[req_id] = handover
                self.cold_start_stats.started += 1
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING
        return failed

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._waiting)

    def wait(self, timeout_s: float) -> None:
        """Block until a waiting request's grammar or cold-start grammar is ready, at most
        `timeout_s`: an engine with nothing else to do sleeps here instead of spinning, which
        would slow the compile threads (they need the GIL to finish)."""
        pending = [
            future
            for _, job in self._waiting.values()
            for future in (job.grammar, job.cold_start)
            if future is not None and not future.done()
        ]
        if pending:
            wait(pending, timeout_s, FIRST_COMPLETED)

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._active.pop(request_id, None)
        self._handovers.pop(request_id, None)

    def active_requests(self) -> list[Request]:
        """The unfinished requests holding a matcher; finished ones are dropped here."""
        for req_id in [r for r, req in self._active.items() if req.status.finished]:
            del self._active[req_id]
            self._handovers.pop(req_id, None)
        return list(self._active.values())

    def _hand_over(self) -> None:
        """Move requests running under a cold-start grammar to their compiled grammar once it
        is ready: a fresh matcher replays the request's output so far and replaces the old one
        if it accepts every token. If it does not (the two backends' languages differ in some
        detail: whitespace, number forms), or the compile failed, the request finishes under
        the cold-start grammar, which enforces the schema exactly too.

        NOTE: called where every matcher has accepted every token sampled so far (before a
        step's masks are filled, after the previous step's tokens were read), so the next
        token is sampled under the new matcher's mask and accepted by it."""
        stats = self.cold_start_stats
        for req_id, future in list(self._handovers.items()):
            if not future.done():
                continue
            del self._handovers[req_id]
            request = self._active.get(req_id)
            if request is None or request.status.finished or not _succeeded(future):
                continue
            grammar = future.result()
            if grammar.backend == request.grammar.grammar.backend:
                continue  # NOTE: outlines-core refused the schema: the same llguidance grammar
            matcher = grammar.new_matcher()
            if matcher.accept_tokens(request.output_token_ids) and not matcher.is_terminated():
                request.grammar = matcher
                stats.handed_over += 1
            else:
                stats.refused += 1

    def fill_bitmask(self, requests: list[Request], logits_rows: np.ndarray) -> StepBitmask | None:
        """The masks of the constrained requests about to sample, filled in place.

        requests: each with a matcher; logits_rows: [len(requests)] int64, the logits row
        each samples in (-1: it does not sample this step). Rows are written in ascending
        logits row order; a slot that already holds the same grammar state's mask keeps it. The host buffer is reused by the next fill: call it only once the
        previous step's tokens were read back (its mask copy is then complete).
        """
        if not requests:
            return None
        if self._handovers:
            self._hand_over()
        order = np.argsort(logits_rows, kind="stable")
        order = order[logits_rows[order] >= 0]
        if not len(order):
            return None
        start = time.perf_counter()
        rows, buffer = self._buffers()
        slot_masks = self._slot_masks
        width = buffer.shape[1]
        reused = 0
        # NOTE: the one Python loop per row of the step: a cached mask row is copied straight
        # into the slot (or left there: the slot already holds that very array); a mask with
        # no cached row (llguidance) is computed into the slot by its matcher.
        for slot, i in enumerate(order.tolist()):
            matcher = requests[i].grammar
            mask = matcher.mask_row()
            if mask is None:
                matcher.fill_bitmask(buffer, slot)
            elif slot_masks[slot] is mask:
                reused += 1
                continue
            else:
                words = mask.shape[0]
                buffer[slot, :words] = mask
                if words != width:
                    buffer[slot, words:] = 0
            slot_masks[slot] = mask
        k = len(order)
        rows[:k] = torch.from_numpy(logits_rows[order])
        stats = self.stats
        stats.calls += 1
        stats.rows += k
        stats.reused += reused
        stats.seconds += time.perf_counter() - start
        return StepBitmask(self._bitmask[:k], rows[:k])  # type: ignore[index]

    def _buffers(self) -> tuple[torch.Tensor, np.ndarray]:
        if self._bitmask is None:
            from loraplex.grammar.bitmask import allocate_token_bitmask

            self._bitmask = allocate_token_bitmask(
                self._max_rows, self._vocab_size, pin_memory=self._pin_memory
            )
            self._bitmask_np = self._bitmask.numpy()
            self._rows = torch.zeros(self._max_rows, dtype=torch.int64, pin_memory=self._pin_memory)
            self._slot_masks = [None] * self._max_rows
        return self._rows, self._bitmask_np  # type: ignore[return-value]

    def reconfigure(self, config: GrammarConfig) -> None:
        """Compile under `config` from now on (benchmarks compare settings on one engine): the
        compiler and its children restart, and what it held in memory is dropped. Call it
        with no grammar request in flight."""
        self.shutdown()
        self._config = config
        self._shut_down = False

    def shutdown(self) -> None:
        with self._compiler_lock:
            self._shut_down = True
            if self._compiler is not None:
                self._compiler.shutdown()
                self._compiler = None


def _succeeded(future: Future) -> bool:
    """True when `future` finished with a result (not an error, not cancelled)."""
    return future.done() and not future.cancelled() and future.exception() is None
