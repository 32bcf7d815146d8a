"""AsyncEngine: the Engine on its own thread, driven from asyncio.

The Engine is not thread-safe, so exactly one thread — the engine thread — ever touches it. The
event loop talks to that thread through a command queue (add / abort / stop, and adapter and
tenant-weight changes, which run between steps); the thread hands
each RequestOutput back to the request's asyncio.Queue with `loop.call_soon_threadsafe`. This
module imports no web framework: the server, benchmarks and tests all drive it the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from loraplex.adapters.request import LoRARequest
from loraplex.config import EngineConfig
from loraplex.platform.core.commands import (
    AdapterAdded,
    AdapterStatsReport,
    AddAdapter,
    EngineCommand,
    GetAdapterStats,
    PinAdapter,
    RemoveAdapter,
    SetTenantWeight,
)
from loraplex.platform.core.errors import EngineDeadError, RequestStalledError
from loraplex.platform.core.outputs import RequestOutput, merge_deltas
from loraplex.platform.core.request import RequestStatus
from loraplex.platform.core.sampling_params import RequestOutputKind, SamplingParams
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.timing import RequestTiming, TimingObserver
from loraplex.platform.engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    prompt_token_ids: list[int] | None
    tenant: str
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    arrival: float
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between steps; its result goes to `future`."""

    fn: Callable[[Engine], object]
    future: concurrent.futures.Future


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request in flight."""

    command: _Add
    first_output: float | None = None
    last_output: float | None = None
    gaps: list[float] = field(default_factory=list)
    # The watchdog's view: what the request's progress looked like, and since when.
    progress: tuple[tuple[int, int], ...] = ()
    progress_since: float = field(default_factory=time.monotonic)


_STOP = object()
_ACCEPTED = object()


class RequestStream:
    """The outputs of one accepted request, as an async iterator; ends after the final one."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        outputs: asyncio.Queue,
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
        # NOTE: a reader that fell behind (a busy API process at hundreds of streams) takes
        # every delta already waiting as one output: one stream event instead of several, so
        # the server catches up instead of falling further behind (vLLM merges the same way).
        # A cumulative output already holds everything before it: the latest one replaces it.
        while not item.finished and not self._outputs.empty():
            later = self._outputs.get_nowait()
            if isinstance(later, BaseException):
                self._error = later
                break
            item = later if self._cumulative else merge_deltas(item, later)
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Stop generating (idempotent); the engine frees the request's KV blocks."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Owns an Engine and the one thread that steps it.

    >>> engine = AsyncEngine(EngineConfig())
    >>> async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
    ...     print(out.outputs[0].text)
    """

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        self.engine = Engine(config, detokenize)
        # NOTE: set once here and read-only afterwards, so any thread may read them.
        self.served_model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.generation_defaults = self.engine.generation_defaults
        self.tokenizer = self.engine.tokenizer
        self.tokenizer_for = self.engine.adapter_tokenizers.get  # any thread (see its doc)
        self.adapter_validator = self.engine.adapter_validator
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._observers: list[TimingObserver] = []
        self._stall_timeout_s = config.scheduler.request_stall_timeout_s
        self._next_watchdog = 0.0
        self.num_watchdog_aborted = 0
        self.num_steps = 0  # engine thread only, like the step time below
        self.step_seconds_total = 0.0
        self._snapshot = self._take_snapshot()
        self._thread: threading.Thread | None = None
        self._request_counter = 0
        self._counter_lock = threading.Lock()
        self.dead_reason: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent), and the grammar compiler beside it (a server
        is long-lived: its first JSON-schema request should not wait for the vocabulary)."""
        if self._thread is None:
            self.engine.structured.prepare()
            self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with EngineDeadError."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add_timing_observer(self, observer: TimingObserver) -> None:
        """Call `observer` on the engine thread with each finished request's latencies."""
        self._observers.append(observer)

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters as of the end of its last step."""
        return self._snapshot

    # -- requests --------------------------------------------------------------------------

    def new_request_id(self, prefix: str = "req") -> str:
        with self._counter_lock:
            self._request_counter += 1
            return f"{prefix}-{self._request_counter}"

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        prompt_token_ids: list[int] | None = None,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepts it.

        Raises what `Engine.add_request` raised (ValueError, PromptTooLongError), or
        EngineDeadError when the engine thread is not running.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_reason
        outputs: asyncio.Queue = asyncio.Queue()
        command = _Add(
            request_id,
            prompt,
            params,
            prompt_token_ids,
            tenant,
            asyncio.get_running_loop(),
            outputs,
            time.monotonic(),
            lora_request,
        )
        self._commands.put(command)
        try:
            ack = await outputs.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(ack, BaseException):
            raise ack
        return RequestStream(self, request_id, outputs, params.output_kind)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are ignored."""
        self._commands.put(_Abort(request_id))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs; aborts the request if the consumer stops early."""
        request_id = request_id or self.new_request_id()
        stream = await self.add_request(
            request_id,
            prompt,
            params,
            prompt_token_ids=prompt_token_ids,
            tenant=tenant,
            lora_request=lora_request,
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    # -- adapters and tenants --------------------------------------------------------------

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_reason
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def command(self, command: EngineCommand) -> object:
        """Run an engine command (`loraplex.platform.core.commands`) on the engine thread
        between steps; returns its result or raises its error (see `Engine.handle_command`)."""
        return await self.call(lambda engine: engine.handle_command(command))

    async def add_adapter(self, command: AddAdapter) -> AdapterAdded:
        """Register (or replace) an adapter; its weights load ahead of its first request."""
        return await self.command(command)  # type: ignore[return-value]

    async def remove_adapter(self, name: str) -> bool:
        """Unregister an adapter; requests already running on it finish on it."""
        return await self.command(RemoveAdapter(name))  # type: ignore[return-value]

    async def pin_adapter(self, name: str, pinned: bool = True) -> bool:
        """Keep an adapter in a GPU slot (or let it go); False if there is none of that name."""
        return await self.command(PinAdapter(name, pinned))  # type: ignore[return-value]

    async def adapter_stats(self) -> AdapterStatsReport:
        """Every adapter's residency, loads and requests, and the slot and cache pools."""
        return await self.command(GetAdapterStats())  # type: ignore[return-value]

    async def add_lora(self, lora_request: LoRARequest) -> str:
        """vLLM's `add_lora`: register a PEFT folder by path (hashed on the engine thread);
        returns its key. Raises AdapterValidationError, or ValueError when LoRA is disabled."""
        added = await self.add_adapter(AddAdapter(lora_request.lora_name, lora_request.lora_path))
        return added.key

    async def remove_lora(self, lora_name: str) -> bool:
        """vLLM's `remove_lora`: `remove_adapter`."""
        return await self.remove_adapter(lora_name)

    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """The tenant's share in the scheduler's weighted fair queuing."""
        await self.command(SetTenantWeight(tenant, weight))

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._handle_commands(block):
                    break
                if self.engine.has_unfinished_requests():
                    start = time.perf_counter()
                    try:
                        self._step()
                    except Exception as exc:
                        logger.exception("an engine step failed; ending the requests it held")
                        self._recover(exc)
                    self.num_steps += 1
                    self.step_seconds_total += time.perf_counter() - start
                self._watchdog()
                self._snapshot = self._take_snapshot()
        except BaseException as exc:
            logger.exception("the engine thread failed")
            self.dead_reason = exc
            self._fail_all(EngineDeadError(f"the engine failed: {exc!r}"))
        else:
            self._fail_all(EngineDeadError("the engine was shut down"))
        finally:
            self.engine.shutdown()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once asked to stop."""
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            elif isinstance(command, _Call):
                self._call(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                prompt_token_ids=command.prompt_token_ids,
                tenant=command.tenant,
                lora_request=command.lora_request,
            )
        except Exception as exc:
            self._deliver(command, exc)
            return
        self._live[command.request_id] = _Live(command)
        self._deliver(command, _ACCEPTED)

    def _call(self, command: _Call) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            command.future.set_result(command.fn(self.engine))
        except Exception as exc:
            command.future.set_exception(exc)

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        final = self.engine.abort_request(request_id)
        if final is not None:
            self._observe(live, final, time.monotonic())
            self._deliver(live.command, final)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            if any(c.token_ids for c in output.outputs):
                if live.first_output is None:
                    live.first_output = now
                else:
                    live.gaps.append(now - live.last_output)
                live.last_output = now
            if output.finished:
                # NOTE: observers (metrics, the tenant's token budget) see a request before its
                # caller does, so a caller's next request is admitted against the charged budget.
                del self._live[output.request_id]
                self._observe(live, output, now)
            self._deliver(live.command, output)

    def _observe(self, live: _Live, output: RequestOutput, now: float) -> None:
        arrival = live.command.arrival
        lora = live.command.lora_request
        first = output.metrics.get("first_token_time", live.first_output)
        scheduled = output.metrics.get("first_scheduled_time")
        reasons = {c.finish_reason for c in output.outputs}
        timing = RequestTiming(
            ttft_s=None if first is None else first - arrival,
            inter_token_s=tuple(live.gaps),
            e2e_s=now - arrival,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_generation_tokens=int(output.metrics.get("num_generation_tokens", 0)),
            finish_reason=reasons.pop() if len(reasons) == 1 else None,
            tenant=live.command.tenant,
            adapter=None if lora is None else lora.lora_name,
            queue_s=None if scheduled is None else max(0.0, scheduled - arrival),
            prefill_s=None if scheduled is None or first is None else max(0.0, first - scheduled),
            decode_s=None if first is None else max(0.0, now - first),
        )
        for observer in self._observers:
            try:
                observer(timing)
            except Exception:
                logger.exception("a timing observer failed")

    def _recover(self, error: Exception) -> None:
        """After a step raised: end every request the engine holds, through the scheduler (its
        blocks and adapter slot freed, the runner told to forget it) and the output processor,
        and hand each waiting caller the error. The engine then serves new requests as before.

        NOTE: a step can raise midway through scheduling or updating, so which requests it
        touched is unknown: all of them end, including any no caller is waiting for."""
        engine = self.engine
        parents = {
            engine.output_processor.parent_of(req_id) for req_id in engine.scheduler.requests
        }
        parents.update(self._live)
        parents.discard(None)
        engine.scheduler.finish_all_requests(RequestStatus.FINISHED_ABORTED)
        for request_id in parents:
            try:
                engine.abort_request(request_id)
            except Exception:
                logger.exception("ending request %s after a failed step failed", request_id)
            live = self._live.pop(request_id, None)
            if live is not None:
                self._deliver(live.command, error)

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
        requests = self.engine.scheduler.requests
        for request_id, live in list(self._live.items()):
            core = (requests.get(i) for i in self.engine.output_processor.core_ids(request_id))
            progress = tuple((r.num_computed_tokens, r.num_output_tokens) for r in core if r)
            if progress != live.progress:
                live.progress, live.progress_since = progress, now
            elif now - live.progress_since >= timeout:
                self._stalled(request_id, live, now)

    def _stalled(self, request_id: str, live: _Live, now: float) -> None:
        message = (
            f"the request made no progress for {self._stall_timeout_s:g} s "
            "(request_stall_timeout_s) and was aborted"
        )
        logger.warning("watchdog: request %s made no progress; aborting it", request_id)
        del self._live[request_id]
        self.num_watchdog_aborted += 1
        final = self.engine.abort_request(request_id, error=RequestStalledError(message))
        if final is None:
            return
        self._observe(live, final, now)
        self._deliver(live.command, final)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request in flight and every queued add (the thread is ending)."""
        for live in self._live.values():
            self._deliver(live.command, error)
        self._live.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._deliver(command, error)
            elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(error)

    @staticmethod
    def _deliver(command: _Add, item: object) -> None:
        try:
            command.loop.call_soon_threadsafe(command.outputs.put_nowait, item)
        except RuntimeError:
            # NOTE: the caller's event loop has closed; nobody is left to read this output.
            pass

    def _take_snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            self.engine.stats(),
            self.engine.prompt_tokens_total,
            self.engine.generation_tokens_total,
            self.num_watchdog_aborted,
            self.num_steps,
            self.step_seconds_total,
        )
