"""InprocClient: the engine in this process, stepped by an EngineLoop on its own thread.

The Engine is not thread-safe, so exactly one thread — the loop's — ever touches it. Callers
(the server's event loop, benchmarks, tests) reach it through the `EngineClient` contract: their
commands go to the loop over a `ThreadTransport`, and each request's outputs come back on its
asyncio.Queue. This module imports no web framework.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable

from loraplex.adapters.request import LoRARequest
from loraplex.config import EngineConfig
from loraplex.platform.core.commands import EngineCommand
from loraplex.platform.core.errors import EngineDeadError
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.tenant_caps import TenantReservation
from loraplex.platform.core.timing import TimingObserver
from loraplex.platform.engine.engine import Engine
from loraplex.platform.engine.engine_loop import EngineLoop
from loraplex.platform.engine.loop_commands import (
    AbortRequests,
    NewRequest,
    RunCommand,
    RunOnEngine,
    Shutdown,
)
from loraplex.platform.engine.protocol import EngineClient
from loraplex.platform.engine.request_stream import RequestStream, StreamItem, accepted_stream
from loraplex.platform.engine.thread_transport import QueueSink, ThreadTransport
from loraplex.platform.engine.warm_up import should_warm_up, warm_up
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer, Tokenizer


class InprocClient(EngineClient):
    """Owns an Engine and the thread that steps it.

    >>> client = InprocClient(EngineConfig())
    >>> client.start()
    >>> async for out in client.generate("Hello", SamplingParams(max_tokens=8)):
    ...     print(out.outputs[0].text)
    """

    def __init__(self, config: EngineConfig, detokenize: bool = True) -> None:
        self.engine = Engine(config, detokenize)
        self._transport = ThreadTransport()
        self._loop = EngineLoop(self.engine, self._transport)
        # NOTE: set once here and read-only afterwards, so any thread may read them.
        self.served_model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.generation_defaults = self.engine.generation_defaults
        self.tokenizer = self.engine.tokenizer
        self.adapter_validator = self.engine.adapter_validator
        self._thread: threading.Thread | None = None
        self._request_counter = 0
        self._counter_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop's thread (idempotent), and the grammar compiler beside it (a server
        is long-lived: its first JSON-schema request should not wait for the vocabulary); on
        CUDA (see `should_warm_up`) the engine runs its warm-up burst first, so the server
        reports ready once it is warm."""
        if self._thread is None:
            self.engine.structured.prepare()
            if should_warm_up(self.engine.runner.device.type):
                warm_up(self.engine)
            self._thread = threading.Thread(
                target=self._loop.run, name="loraplex-engine", daemon=True
            )
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._transport.put(Shutdown())
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> BaseException | None:
        """Why the loop failed, if it did."""
        return self._loop.dead_reason

    def add_timing_observer(self, observer: TimingObserver) -> None:
        """Called on the loop's thread (see `EngineLoop.add_timing_observer`)."""
        self._loop.add_timing_observer(observer)

    def snapshot(self) -> EngineSnapshot:
        """As of the end of the loop's last pass."""
        return self._loop.snapshot

    def tokenizer_for(self, lora_request: LoRARequest | None) -> Tokenizer | TokenIdsOnlyTokenizer:
        return self.engine.adapter_tokenizers.get(lora_request)

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
        reservation: TenantReservation | None = None,
    ) -> RequestStream:
        self._check_running()
        outputs: asyncio.Queue[StreamItem] = asyncio.Queue()
        sink = QueueSink(asyncio.get_running_loop(), outputs)
        self._transport.put(
            NewRequest(
                request_id,
                prompt,
                params,
                prompt_token_ids,
                tenant,
                lora_request,
                time.monotonic(),
                sink,
                reservation,
            )
        )
        return await accepted_stream(self, request_id, outputs, params.output_kind)

    def abort(self, request_id: str) -> None:
        self._transport.put(AbortRequests((request_id,)))

    async def command(self, command: EngineCommand) -> object:
        self._check_running()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._transport.put(RunCommand(command, future))
        return await asyncio.wrap_future(future)

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """Run `fn(engine)` on the loop's thread between steps and return its result: for tests
        and tools in this process that inspect or adjust the engine (not part of
        EngineClient: an engine in another process cannot take a function)."""
        self._check_running()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._transport.put(RunOnEngine(fn, future))
        return await asyncio.wrap_future(future)

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self.dead_reason
