"""The engine's side of structured output: compile in the background, give each request a
matcher once its grammar is ready, and fill a launched step's token bitmask rows on the CPU
while the device runs its forward pass."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from loraplex.platform.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from loraplex.grammar.compiled import CompiledGrammar
    from loraplex.grammar.compiler import GrammarCompiler
    from loraplex.grammar.config import GrammarConfig
    from loraplex.grammar.params import StructuredOutputs
    from loraplex.platform.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class StepBitmask:
    """The grammar masks of one step, in host memory (pinned on CUDA) the sampler copies.

    Row i of `bitmask` masks logits row `rows[i]`; rows ascend. Valid until the next fill."""

    bitmask: torch.Tensor  # [k, words] int32
    rows: torch.Tensor  # [k] int64


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
        self._waiting: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        # Requests holding a matcher, until they finish.
        self._active: dict[str, Request] = {}
        self._bitmask: torch.Tensor | None = None  # [max_rows, words] int32
        self._bitmask_np: np.ndarray | None = None  # its numpy view
        self._rows: torch.Tensor | None = None  # [max_rows] int64
        # What each bitmask slot holds now: a matcher's `mask_key`, or None (unknown).
        self._slot_keys: list[object] = []
        self.stats = MaskFillStats()

    @property
    def compiler(self) -> GrammarCompiler:
        """Started on first use: it spawns compile worker processes."""
        if self._compiler is None:
            from loraplex.grammar.compiler import GrammarCompiler
            from loraplex.grammar.vocabulary import build_vocabulary

            vocab = build_vocabulary(self._tokenizer.backend, self._stop_token_ids)
            self._compiler = GrammarCompiler(vocab, self._config)
        return self._compiler

    @property
    def num_active(self) -> int:
        """Requests holding a matcher (some may have finished since the last fill)."""
        return len(self._active)

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """Start (or reuse) a compile; raises GrammarError at once for refused specs."""
        return self.compiler.submit(spec)

    def add_request(self, request: Request, future: Future[CompiledGrammar]) -> None:
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._waiting[request.request_id] = (request, future)

    def poll(self) -> list[tuple[Request, Exception]]:
        """Hand matchers to requests whose grammar is ready; returns the failed ones."""
        if not self._waiting:
            return []
        failed = []
        for req_id, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[req_id]
            if request.status.finished:
                continue
            try:
                request.grammar = future.result().new_matcher()
            except Exception as exc:  # a GrammarError from the compile
                failed.append((request, exc))
                continue
            self._active[req_id] = request
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING
        return failed

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._active.pop(request_id, None)

    def active_requests(self) -> list[Request]:
        """The unfinished requests holding a matcher; finished ones are dropped here."""
        for req_id in [r for r, req in self._active.items() if req.status.finished]:
            del self._active[req_id]
        return list(self._active.values())

    def fill_bitmask(self, requests: list[Request], logits_rows: np.ndarray) -> StepBitmask | None:
        """The masks of the constrained requests about to sample, filled in place.

        requests: each with a matcher; logits_rows: [len(requests)] int64, the logits row
        each samples in (-1: it does not sample this step). Rows are written in ascending
        logits row order, one call per row; a slot that already holds the same grammar state
        keeps its mask. The host buffer is reused by the next fill: call it only once the
        previous step's tokens were read back (its mask copy is then complete).
        """
        if not requests:
            return None
        order = np.argsort(logits_rows, kind="stable")
        order = order[logits_rows[order] >= 0]
        if not len(order):
            return None
        start = time.perf_counter()
        rows, buffer = self._buffers()
        slot_keys = self._slot_keys
        reused = 0
        for slot, i in enumerate(order.tolist()):
            matcher = requests[i].grammar
            key = matcher.mask_key()
            if key is not None and slot_keys[slot] == key:
                reused += 1
                continue
            matcher.fill_bitmask(buffer, slot)
            slot_keys[slot] = key
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
            self._slot_keys = [None] * self._max_rows
        return self._rows, self._bitmask_np  # type: ignore[return-value]

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
            self._compiler = None
