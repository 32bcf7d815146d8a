"""EngineLoop: one Engine stepped on one thread, serving the requests a transport brings.

The loop owns what serving adds to the engine: the table of requests in flight and where their
answers go, their latencies (handed to timing observers), tenants' caps (`TenantLimits`: every
request passes here, whichever API process sent it), the watchdog, recovery after a step that
raised, and the snapshot of gauges published after every pass. Two transports plug into
it: the thread transport of `InprocClient` (asyncio callers in the same process) and the
ZeroMQ transport of the EngineCore process (API processes). The loop knows neither: commands
arrive typed (`loop_commands`), and each request's answers go to the sink it came with.

Each pass: take the commands that arrived (waiting for one while the engine is idle) and run
them, one handler per command type; let the transport send what they produced (a request's
acknowledgement goes out before the step); step; watch for stalled requests; publish the
snapshot and let the transport send the step's outputs.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.platform.core.errors import (
    EngineDeadError,
    RequestStalledError,
    TenantLimitExceeded,
)
from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.timing import RequestTiming, TimingObserver
from loraplex.platform.engine.engine import Engine
from loraplex.platform.engine.loop_commands import (
    AbortRequests,
    LoopCommand,
    NewRequest,
    OutputSink,
    RunCommand,
    RunOnEngine,
    Shutdown,
    StopSamples,
)
from loraplex.platform.engine.tenant_limits import TenantLimits

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """How commands reach an EngineLoop, and how what a pass produced leaves it. Every method
    is called on the loop's thread."""

    def receive(self, block: bool) -> Sequence[LoopCommand]:
        """The commands that arrived since the last call, in order; none may have. `block`:
        the engine is idle, so wait for one (a transport may give up after a while)."""

    def flush(self, snapshot: EngineSnapshot, idle: bool) -> None:
        """Send what the requests' sinks gathered, after the commands ran and after each pass;
        `snapshot` is the latest gauges, `idle` whether the engine has nothing left to do."""

    def drain(self) -> Sequence[LoopCommand]:
        """The loop is ending: the commands received and not run (they are failed)."""

    def close(self, snapshot: EngineSnapshot) -> None:
        """The loop has ended: send what is left and release the transport."""


@dataclass(slots=True)
class LiveRequest:
    """A request in flight: where its answers go, and its latencies so far."""

    request: NewRequest
    sink: OutputSink
    first_output: float | None = None
    last_output: float = 0.0
    gaps: list[float] = field(default_factory=list)
    # The watchdog's view: what the request's progress looked like, and since when.
    progress: tuple[tuple[int, int], ...] = ()
    progress_since: float = field(default_factory=time.monotonic)


class EngineLoop:
    """Steps `engine` and serves the commands `transport` brings; `run` on the thread that owns
    the engine. Other threads may read `snapshot` and `dead_reason`."""

    def __init__(self, engine: Engine, transport: Transport) -> None:
        self.engine = engine
        self.transport = transport
        self._live: dict[str, LiveRequest] = {}
        self.tenant_limits = TenantLimits()
        self._observers: list[TimingObserver] = []
        self._stall_timeout_s = engine.config.scheduler.request_stall_timeout_s
        self._next_watchdog = 0.0
        self._running = True
        self._handlers: dict[type, Callable[[Any], None]] = {
            NewRequest: self._add,
            AbortRequests: self._abort,
            StopSamples: self._stop_samples,
            RunCommand: self._run_command,
            RunOnEngine: self._run_on_engine,
            Shutdown: self._shutdown,
        }
        self.num_watchdog_aborted = 0
        self.num_steps = 0
        self.step_seconds_total = 0.0
        self.dead_reason: BaseException | None = None
        self.snapshot = self._take_snapshot()

    def add_timing_observer(self, observer: TimingObserver) -> None:
        """Call `observer` on the loop's thread with each finished request's latencies, before
        the request's final output goes to its sink."""
        self._observers.append(observer)

    def run(self) -> None:
        """Serve until a `Shutdown` (or a failure of the loop itself); then every request in
        flight fails with EngineDeadError and the engine is shut down."""
        try:
            self._serve()
        except BaseException as exc:
            logger.exception("the engine loop failed")
            self.dead_reason = exc
            self._fail_all(EngineDeadError(f"the engine failed: {exc!r}"))
        else:
            self._fail_all(EngineDeadError("the engine was shut down"))
        finally:
            self.engine.shutdown()
            self.transport.close(self.snapshot)

    def _serve(self) -> None:
        engine, transport, handlers = self.engine, self.transport, self._handlers
        # NOTE: only this thread changes the engine, so `idle` holds until a command runs.
        idle = not engine.has_unfinished_requests()
        while True:
            commands = transport.receive(block=idle)
            if commands:
                for command in commands:
                    handlers[type(command)](command)
                if not self._running:
                    return
                idle = not engine.has_unfinished_requests()
                # NOTE: acknowledgements and command results go out now, not after the step:
                # a request of many prompts adds them one acknowledgement at a time.
                transport.flush(self.snapshot, idle)
            if not idle:
                start = time.perf_counter()
                try:
                    self._route(engine.step(), time.monotonic())
                except Exception as exc:
                    logger.exception("an engine step failed; ending the requests it held")
                    self._recover(exc)
                self.num_steps += 1
                self.step_seconds_total += time.perf_counter() - start
            self._watchdog()
            self.snapshot = self._take_snapshot()
            idle = not engine.has_unfinished_requests()
            transport.flush(self.snapshot, idle)

    # -- commands --------------------------------------------------------------------------

    def _add(self, command: NewRequest) -> None:
        request_id = command.request_id
        # NOTE: a request id already in flight is the engine's to refuse; it holds nothing here
        limited = command.reservation is not None and request_id not in self._live
        if limited:
            try:
                self.tenant_limits.admit(request_id, command.tenant, command.reservation)
            except TenantLimitExceeded as exc:
                command.sink.refused(request_id, exc)
                return
        try:
            self.engine.add_request(
                request_id,
                command.prompt,
                command.params,
                prompt_token_ids=command.prompt_token_ids,
                tenant=command.tenant,
                lora_request=command.lora_request,
            )
        except Exception as exc:
            if limited:
                self.tenant_limits.release(request_id)
            command.sink.refused(request_id, exc)
            return
        self._live[request_id] = LiveRequest(command, command.sink)
        command.sink.accepted(request_id)

    def _abort(self, command: AbortRequests) -> None:
        for request_id in command.request_ids:
            live = self._live.pop(request_id, None)
            if live is None:
                continue
            final = self.engine.abort_request(request_id)
            if final is not None:
                self._finish(live, final, time.monotonic())
            else:
                self.tenant_limits.release(request_id)

    def _stop_samples(self, command: StopSamples) -> None:
        self._route(self.engine.stop_samples(command.hits), time.monotonic())

    def _run_command(self, command: RunCommand) -> None:
        _settle(command.future, self.engine.handle_command, command.command)

    def _run_on_engine(self, command: RunOnEngine) -> None:
        _settle(command.future, command.fn, self.engine)

    def _shutdown(self, command: Shutdown) -> None:
        self._running = False

    # -- outputs ---------------------------------------------------------------------------

    def _route(self, outputs: list[RequestOutput], now: float) -> None:
        """Hand each output to its request's sink, timing the ones that carry tokens."""
        live_requests = self._live
        for output in outputs:
            live = live_requests.get(output.request_id)
            if live is None:
                continue
            if any(c.token_ids for c in output.outputs):
                if live.first_output is None:
                    live.first_output = now
                else:
                    live.gaps.append(now - live.last_output)
                live.last_output = now
            if output.finished:
                del live_requests[output.request_id]
                self._finish(live, output, now)
            else:
                live.sink.output(output)

    def _finish(self, live: LiveRequest, final: RequestOutput, now: float) -> None:
        """Hand out a request's final output (it has left the table).

        NOTE: its tenant is charged and observers (metrics) see the request before its caller
        does, so a caller's next request is admitted against the charged budget."""
        timing = self._observe(live, final, now)
        used = timing.num_prompt_tokens + timing.num_generation_tokens
        self.tenant_limits.finish(live.request.request_id, used)
        live.sink.output(final)

    def _observe(self, live: LiveRequest, output: RequestOutput, now: float) -> RequestTiming:
        request = live.request
        lora = request.lora_request
        first = output.metrics.first_token_time
        if first is None:
            first = live.first_output
        scheduled = output.metrics.first_scheduled_time
        reasons = {c.finish_reason for c in output.outputs}
        timing = RequestTiming(
            ttft_s=None if first is None else first - request.arrival,
            inter_token_s=tuple(live.gaps),
            e2e_s=now - request.arrival,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_generation_tokens=output.metrics.num_generation_tokens,
            finish_reason=reasons.pop() if len(reasons) == 1 else None,
            tenant=request.tenant,
            adapter=None if lora is None else lora.lora_name,
            queue_s=None if scheduled is None else max(0.0, scheduled - request.arrival),
            prefill_s=None if scheduled is None or first is None else max(0.0, first - scheduled),
            decode_s=None if first is None else max(0.0, now - first),
        )
        for observer in self._observers:
            try:
                observer(timing)
            except Exception:
                logger.exception("a timing observer failed")
        return timing

    # -- failures --------------------------------------------------------------------------

    def _recover(self, error: Exception) -> None:
        """After a step raised: end every request the engine holds (`Engine.end_all_requests`)
        and hand each waiting caller the error. The engine then serves new requests."""
        self.engine.end_all_requests(self._live)
        live, self._live = self._live, {}
        for request_id, request in live.items():
            self.tenant_limits.release(request_id)
            request.sink.failed(request_id, error)

    def _watchdog(self) -> None:
        """End requests that made no progress for `request_stall_timeout_s` (checked at most
        about once a second), freeing their blocks and adapter slots.

        Progress is any change of a request's computed or output token counts: a prefill chunk
        or a token. Waiting for a grammar, for an adapter, or in the queue behind a full server
        is no progress, so a request not admitted within the timeout ends too (by then its
        client has long given up). A step that never returns is beyond its reach."""
        timeout = self._stall_timeout_s
        now = time.monotonic()
        if not timeout or not self._live or now < self._next_watchdog:
            return
        self._next_watchdog = now + min(1.0, timeout / 4)
        for request_id, live in list(self._live.items()):
            progress = self.engine.progress(request_id)
            if progress != live.progress:
                live.progress, live.progress_since = progress, now
            elif now - live.progress_since >= timeout:
                self._stalled(request_id, live, now)

    def _stalled(self, request_id: str, live: LiveRequest, now: float) -> None:
        message = (
            f"the request made no progress for {self._stall_timeout_s:g} s "
            "(request_stall_timeout_s) and was aborted"
        )
        logger.warning("watchdog: request %s made no progress; aborting it", request_id)
        del self._live[request_id]
        self.num_watchdog_aborted += 1
        final = self.engine.abort_request(request_id, error=RequestStalledError(message))
        if final is not None:
            self._finish(live, final, now)
        else:
            self.tenant_limits.release(request_id)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request in flight and every command not run (the loop is ending)."""
        live, self._live = self._live, {}
        for request_id, request in live.items():
            self.tenant_limits.release(request_id)
            request.sink.failed(request_id, error)
        for command in self.transport.drain():
            if isinstance(command, NewRequest):
                command.sink.refused(command.request_id, error)
            elif isinstance(command, (RunCommand, RunOnEngine)):
                if command.future.set_running_or_notify_cancel():
                    command.future.set_exception(error)

    def _take_snapshot(self) -> EngineSnapshot:
        engine = self.engine
        return EngineSnapshot(
            engine.stats(),
            engine.prompt_tokens_total,
            engine.generation_tokens_total,
            self.num_watchdog_aborted,
            self.num_steps,
            self.step_seconds_total,
        )


def _settle(future: concurrent.futures.Future, fn: Callable[[Any], object], arg: object) -> None:
    """Run `fn(arg)` into `future`, unless its caller has cancelled it."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(arg))
    except Exception as exc:
        future.set_exception(exc)
