"""EngineCoreClient: the API process's handle on the EngineCore process, an `EngineClient` as
`InprocClient` is, so routes do not care which one they hold.

One DEALER socket per API process; one asyncio task reads the core's per-step batches, turns
their token ids into text (`ClientOutputs`: detokenization and stop strings run here, not in
the core, which this client tells to stop a sample whose text matched a stop string) and hands
each output to its request's queue. Nothing here blocks the event loop except the handshake in
the constructor (before the server starts), which also loads the tokenizer the API process
tokenizes and renders chat templates with.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path

import zmq
import zmq.asyncio

from loraplex.adapters.request import LoRARequest
from loraplex.platform.core.commands import EngineCommand
from loraplex.platform.core.errors import EngineDeadError
from loraplex.platform.core.sampling_params import RequestOutputKind, SamplingParams
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.tenant_caps import TenantReservation
from loraplex.platform.core.timing import TimingObserver
from loraplex.platform.engine.client_outputs import ClientOutputs
from loraplex.platform.engine.ipc import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    Codec,
    CoreBatch,
    EngineInfo,
    Hello,
    Stop,
    lora_to_wire,
    rebuild_error,
)
from loraplex.platform.engine.protocol import EngineClient
from loraplex.platform.engine.request_stream import (
    ACCEPTED,
    RequestStream,
    StreamItem,
    accepted_stream,
)
from loraplex.platform.tokenizer.adapter_tokenizers import AdapterTokenizers
from loraplex.platform.tokenizer.tokenizer import (
    TokenIdsOnlyTokenizer,
    Tokenizer,
    load_tokenizer,
)

logger = logging.getLogger(__name__)


class EngineCoreClient(EngineClient):
    """Talks to the EngineCore bound at `address`; `start()` on the server's event loop."""

    def __init__(self, address: str, handshake_timeout_s: float = 600.0) -> None:
        self.address = address
        self._codec = Codec()
        self.info = self.probe(address, handshake_timeout_s)
        self.served_model_name = self.info.served_model_name
        self.max_model_len = self.info.max_model_len
        self.generation_defaults = self.info.generation_defaults
        self.tokenizer = load_tokenizer(Path(self.info.model_dir), self.info.vocab_size)
        # NOTE: read-only after this: the routes' threads and the event loop call it.
        self._adapter_tokenizers = AdapterTokenizers(self.tokenizer)
        self.adapter_validator = self.info.adapter_validator
        self._observers: list[TimingObserver] = []
        self._queues: dict[str, asyncio.Queue[StreamItem]] = {}
        self._outputs = ClientOutputs(self.tokenizer)
        self._results: dict[int, asyncio.Future] = {}
        self._seq = itertools.count()
        self._snapshot: EngineSnapshot | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._prefix = f"{uuid.uuid4().hex[:8]}"
        self._request_counter = itertools.count(1)
        self.dead_reason: BaseException | None = None

    @staticmethod
    def probe(address: str, timeout_s: float) -> EngineInfo:
        """The EngineInfo of the core at `address`; TimeoutError if it does not answer within
        `timeout_s`, RuntimeError if it speaks another protocol version."""
        codec = Codec()
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(address)
            socket.send(codec.encode(Hello(PROTOCOL_VERSION)))
            deadline = time.monotonic() + timeout_s
            while True:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not socket.poll(remaining_ms):
                    raise TimeoutError(f"the engine core at {address} did not answer")
                message = codec.decode_core(socket.recv())
                if isinstance(message, EngineInfo):
                    break
        finally:
            socket.close()
        if message.version != PROTOCOL_VERSION:
            raise RuntimeError(
                f"the engine core speaks protocol {message.version}, this server "
                f"{PROTOCOL_VERSION}; run one loraplex version"
            )
        return message

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Connect and start reading the core's batches (on the running event loop)."""
        if self._socket is not None:
            return
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        self._socket.send(self._codec.encode(Hello(PROTOCOL_VERSION)))
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop reading; requests still in flight here fail with EngineDeadError."""
        self.fail_all(EngineDeadError("the server is shutting down"))
        if self._reader is not None:
            self._reader.cancel()
        if self._socket is not None:
            self._socket.close()

    @property
    def is_running(self) -> bool:
        return self._reader is not None and not self._reader.done() and self.dead_reason is None

    def fail_all(self, error: EngineDeadError) -> None:
        """End every request and command in flight with `error`; new ones fail with it too
        once `dead_reason` is set (see `mark_dead`)."""
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        self._outputs = ClientOutputs(self.tokenizer)
        for future in self._results.values():
            if not future.done():
                future.set_exception(error)
        self._results.clear()

    def mark_dead(self, reason: str) -> None:
        """The engine core is gone: fail everything in flight, refuse everything new."""
        error = EngineDeadError(reason)
        self.dead_reason = error
        self.fail_all(error)

    def add_timing_observer(self, observer: TimingObserver) -> None:
        """Call `observer` with each finished request's latencies (every API process sees
        every request of the server, so each one's metrics describe the whole server)."""
        self._observers.append(observer)

    def snapshot(self) -> EngineSnapshot:
        """The engine's gauges and counters as the core last published them."""
        if self._snapshot is None:
            raise EngineDeadError("no snapshot from the engine core yet")
        return self._snapshot

    def tokenizer_for(self, lora_request: LoRARequest | None) -> Tokenizer | TokenIdsOnlyTokenizer:
        return self._adapter_tokenizers.get(lora_request)

    # -- requests --------------------------------------------------------------------------

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{self._prefix}-{next(self._request_counter)}"

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
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        # NOTE: text is tokenized here (the core need not) and client token ids go as the
        # prompt, for the core to check against the vocabulary.
        tokenizer = self.tokenizer_for(lora_request)  # the adapter's own tokenizer, if it has one
        token_ids = prompt_token_ids
        if token_ids is None:
            token_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if isinstance(prompt, str):
                prompt_token_ids = token_ids
        # NOTE: the core hands out every step's tokens; this process gives the caller its kind.
        wire_params = params
        if params.output_kind != RequestOutputKind.DELTA:
            wire_params = replace(params, output_kind=RequestOutputKind.DELTA)
        outputs: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._queues[request_id] = outputs
        self._outputs.add_request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params,
            tokenizer=tokenizer,
        )  # fmt: skip
        message = AddRequest(
            request_id,
            prompt,
            wire_params,
            prompt_token_ids,
            tenant,
            lora_to_wire(lora_request),
            time.monotonic(),
            reservation,
        )
        await self._send(message)
        return await accepted_stream(self, request_id, outputs, params.output_kind)

    def abort(self, request_id: str) -> None:
        if self._socket is None or self.dead_reason is not None:
            return
        # NOTE: keep the queue until the core's final output, so the request's last output
        # (finish reason "abort") still reaches a reader that waits for it.
        self._socket.send(self._codec.encode(Abort([request_id])), zmq.NOBLOCK)

    # -- engine commands -------------------------------------------------------------------

    async def command(self, command: EngineCommand) -> object:
        self._check_alive()
        seq = next(self._seq)
        future = asyncio.get_running_loop().create_future()
        self._results[seq] = future
        try:
            await self._send(self._codec.command(seq, command))
            return await future
        finally:
            self._results.pop(seq, None)

    # -- the reader ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None or self._socket is None:
            raise EngineDeadError("the engine is not running") from self.dead_reason

    async def _send(self, message: object) -> None:
        assert self._socket is not None
        await self._socket.send(self._codec.encode(message))

    async def _read(self) -> None:
        socket = self._socket
        assert socket is not None
        while True:
            frames = [await socket.recv()]
            # NOTE: awaiting a message that is already there does not yield to the event loop,
            # so a reader that fell behind the core would hand out batch after batch while no
            # stream sends a byte. Every batch waiting is applied, then the streams run (each
            # one's waiting deltas merge into one event: see `RequestStream`).
            while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                frames.append(await socket.recv())
            for data in frames:
                try:
                    message = self._codec.decode_core(data)
                except Exception:
                    logger.exception("a malformed message from the engine core was dropped")
                    continue
                if isinstance(message, CoreBatch):
                    self._apply(message)
            await asyncio.sleep(0)

    def _apply(self, batch: CoreBatch) -> None:
        # NOTE: observers (metrics, tenants' token budgets) see a finished request before its
        # caller does (the EngineClient contract).
        for timing in batch.timings:
            for observer in self._observers:
                try:
                    observer(timing)
                except Exception:
                    logger.exception("a timing observer failed")
        if batch.snapshot is not None:
            self._snapshot = batch.snapshot
        for ack in batch.acks:
            queue = self._queues.get(ack.request_id)
            if ack.error is not None:
                # NOTE: here, not in add_request: its caller may have been cancelled.
                self._queues.pop(ack.request_id, None)
                self._outputs.forget(ack.request_id)
            if queue is not None:
                queue.put_nowait(ACCEPTED if ack.error is None else rebuild_error(ack.error))
        if batch.outputs:
            outputs, stops = self._outputs.process_core(batch.outputs)
            if stops and self._socket is not None:
                self._socket.send(self._codec.encode(Stop(stops)), zmq.NOBLOCK)
            for output in outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                    if output.finished:
                        del self._queues[output.request_id]
        for failure in batch.failures:
            self._outputs.forget(failure.request_id)
            queue = self._queues.pop(failure.request_id, None)
            if queue is not None:
                queue.put_nowait(rebuild_error(failure.error))
        for result in batch.results:
            future = self._results.get(result.seq)
            if future is None or future.done():
                continue
            try:
                future.set_result(self._codec.result_of(result))
            except Exception as error:
                future.set_exception(error)


def default_address() -> str:
    """A fresh ipc:// endpoint in the temporary folder, for one server's engine core."""
    folder = Path(os.environ.get("TMPDIR", "/tmp"))
    return f"ipc://{folder}/loraplex-engine-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
