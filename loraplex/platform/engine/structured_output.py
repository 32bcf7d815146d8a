"""The engine's side of structured output: compile in the background, give each request a
matcher once its grammar is ready, and fill the step's token bitmask rows on the CPU."""

from __future__ import annotations

from concurrent.futures import Future
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


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_token_ids: tuple[int, ...],
        vocab_size: int,
        max_num_seqs: int,
        config: GrammarConfig | None = None,
    ) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._stop_token_ids = stop_token_ids
        self._vocab_size = vocab_size
        self._max_rows = max_num_seqs
        self._compiler: GrammarCompiler | None = None
        self._waiting: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        self._bitmask: torch.Tensor | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        """Started on first use: it spawns compile worker processes."""
        if self._compiler is None:
            from loraplex.grammar.compiler import GrammarCompiler
            from loraplex.grammar.vocabulary import build_vocabulary

            vocab = build_vocabulary(self._tokenizer.backend, self._stop_token_ids)
            self._compiler = GrammarCompiler(vocab, self._config)
        return self._compiler

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
        from loraplex.grammar.matcher import GrammarMatcher

        failed = []
        for req_id, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[req_id]
            if request.status.finished:
                continue
            try:
                request.grammar = GrammarMatcher(future.result())
            except Exception as exc:  # a GrammarError from the compile
                failed.append((request, exc))
                continue
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING
        return failed

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def fill_bitmasks(self, requests: list[Request]) -> dict[str, torch.Tensor]:
        """One packed allowed-token row per constrained request about to sample."""
        if not requests:
            return {}
        if self._bitmask is None:
            from loraplex.grammar.bitmask import allocate_token_bitmask

            self._bitmask = allocate_token_bitmask(self._max_rows, self._vocab_size)
        rows: np.ndarray = self._bitmask.numpy()
        out = {}
        for i, request in enumerate(requests):
            request.grammar.fill_bitmask(rows, i)
            out[request.request_id] = self._bitmask[i]
        return out

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
            self._compiler = None
