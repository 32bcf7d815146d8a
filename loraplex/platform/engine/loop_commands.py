"""What a transport hands the EngineLoop (typed, frozen), and where the loop sends each request's
answers (`OutputSink`).

A transport turns what its callers send (asyncio calls on the thread transport, ZeroMQ
messages on the engine-core process's) into these commands; the loop runs them between steps,
one handler per command type. Each request names the sink its answers go to, so the loop
routes every output one way whichever transport brought the request.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loraplex.adapters.request import LoRARequest
from loraplex.platform.core.commands import EngineCommand
from loraplex.platform.core.outputs import RequestOutput, StopHit
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.tenant_caps import TenantReservation

if TYPE_CHECKING:
    from loraplex.platform.engine.engine import Engine


class OutputSink(Protocol):
    """Where the engine loop sends one request's answers (called on the loop's thread; must not
    block). Exactly one of `accepted` / `refused` comes first; after `accepted`, outputs until
    the finished one, or `failed`."""

    def accepted(self, request_id: str) -> None:
        """The engine took the request."""

    def refused(self, request_id: str, error: BaseException) -> None:
        """The engine did not take the request (it raised `error` adding it, or stopped)."""

    def output(self, output: RequestOutput) -> None:
        """An output of an accepted request."""

    def failed(self, request_id: str, error: BaseException) -> None:
        """An accepted request ended without a final output (a failed step, the loop's end)."""


@dataclass(frozen=True)
class NewRequest:
    """Add a request; its answers go to `sink`. `arrival` is `time.monotonic()` when the
    caller sent it (one clock per host), the start of its latencies. `reservation`: what it
    holds of its tenant's caps while it runs (None: it counts against none)."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    prompt_token_ids: list[int] | None
    tenant: str
    lora_request: LoRARequest | None
    arrival: float
    sink: OutputSink
    reservation: TenantReservation | None = None


@dataclass(frozen=True)
class AbortRequests:
    """End these requests (unknown or finished ids are ignored)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class StopSamples:
    """End the samples whose text matched a stop string (found by an API process)."""

    hits: tuple[StopHit, ...]


@dataclass(frozen=True)
class RunCommand:
    """Run an engine command; its result or error goes to `future` (not run if cancelled)."""

    command: EngineCommand
    future: concurrent.futures.Future


@dataclass(frozen=True)
class RunOnEngine:
    """Run `fn(engine)` between steps; its result or error goes to `future` (not run if
    cancelled). In-process only: tests and tools that inspect the engine."""

    fn: Callable[[Engine], object]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class Shutdown:
    """End the loop; the commands before it run, those after it fail with EngineDeadError."""


LoopCommand = NewRequest | AbortRequests | StopSamples | RunCommand | RunOnEngine | Shutdown
