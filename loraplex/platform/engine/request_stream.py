"""RequestStream: one accepted request's outputs, as an async iterator, for every EngineClient.

Whichever client serves a request, the engine's answers reach its caller on one asyncio.Queue:
first `Accepted` or the exception that refused it, then its outputs, ending with the finished
one or an exception (the engine stopped, the request failed after it was accepted).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.platform.core.outputs import RequestOutput, merge_deltas
from loraplex.platform.core.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from loraplex.platform.engine.protocol import EngineClient


@dataclass(frozen=True)
class Accepted:
    """The engine has taken the request: its outputs follow on the same queue."""


ACCEPTED = Accepted()

# What a request's queue holds: the engine's answer, then outputs, or an error that ends it.
StreamItem = Accepted | RequestOutput | BaseException


class RequestStream:
    """The outputs of one accepted request, as an async iterator; ends after the final one."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        outputs: asyncio.Queue[StreamItem],
        kind: RequestOutputKind = RequestOutputKind.DELTA,
    ) -> None:
        self.request_id = request_id
        self._engine = engine
        self._outputs = outputs
        self._cumulative = kind == RequestOutputKind.CUMULATIVE
        self._error: BaseException | None = None  # raised after the outputs before it
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = self._error or await self._outputs.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert isinstance(item, RequestOutput)
        # NOTE: a reader that fell behind (a busy API process at hundreds of streams) takes
        # every delta already waiting as one output: one stream event instead of several, so
        # the server catches up instead of falling further behind (vLLM merges the same way).
        # A cumulative output already holds everything before it: the latest one replaces it.
        while not item.finished and not self._outputs.empty():
            later = self._outputs.get_nowait()
            if isinstance(later, BaseException):
                self._error = later
                break
            assert isinstance(later, RequestOutput)
            item = later if self._cumulative else merge_deltas(item, later)
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Stop generating (idempotent); the engine frees the request's KV blocks."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


async def accepted_stream(
    engine: EngineClient,
    request_id: str,
    outputs: asyncio.Queue[StreamItem],
    kind: RequestOutputKind,
) -> RequestStream:
    """The end of every `EngineClient.add_request`, once the request is on its way: wait for
    the engine's answer on `outputs`; raise the refusal, or return the request's stream. A
    caller cancelled while it waits aborts the request."""
    try:
        answer = await outputs.get()
    except asyncio.CancelledError:
        engine.abort(request_id)
        raise
    if isinstance(answer, BaseException):
        raise answer
    return RequestStream(engine, request_id, outputs, kind)
