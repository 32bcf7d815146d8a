"""ZmqTransport: an EngineLoop's transport to API processes, on a ZeroMQ ROUTER socket.

Each API process connects a DEALER socket and sends `ipc` messages; they become loop commands.
What the loop produces for a process (acknowledgements, outputs, failures, command results)
gathers in one `CoreBatch` per process and goes out when the loop flushes: after the commands
of a pass ran (so acknowledgements never wait for a step) and after each step. Every finished
request's timing goes to every process, so each one's metrics describe the whole server, and
the engine snapshot goes out at most every `SNAPSHOT_INTERVAL_S` while the engine is busy.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from loraplex.platform.core.outputs import RequestOutput
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.timing import RequestTiming
from loraplex.platform.engine.ipc import (
    PROTOCOL_VERSION,
    SNAPSHOT_INTERVAL_S,
    Abort,
    AddRequest,
    AddResult,
    Codec,
    CommandRequest,
    CommandResult,
    CoreBatch,
    EngineInfo,
    Hello,
    RequestFailure,
    Stop,
    error_info,
    lora_from_wire,
    refusal,
)
from loraplex.platform.engine.loop_commands import (
    AbortRequests,
    LoopCommand,
    NewRequest,
    RunCommand,
    Shutdown,
    StopSamples,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle core waits for a message before it looks around again


class ClientSink:
    """The answers to one API process's requests, gathered in its next `CoreBatch`."""

    def __init__(self, transport: ZmqTransport, client: bytes) -> None:
        self._transport = transport
        self._client = client

    def accepted(self, request_id: str) -> None:
        self._transport.batch(self._client).acks.append(AddResult(request_id))

    def refused(self, request_id: str, error: BaseException) -> None:
        self._transport.batch(self._client).acks.append(AddResult(request_id, error_info(error)))

    def output(self, output: RequestOutput) -> None:
        # NOTE: the API process holds the prompt; only what is new crosses (the loop has read
        # the prompt's length for the request's timing already).
        output.prompt, output.prompt_token_ids = None, []
        self._transport.batch(self._client).outputs.append(output)

    def failed(self, request_id: str, error: BaseException) -> None:
        failure = RequestFailure(request_id, error_info(error))
        self._transport.batch(self._client).failures.append(failure)


class ZmqTransport:
    """The loop's end of the API processes' sockets, bound to `address` (e.g. ipc:///tmp/x).

    `info` answers each process's `Hello`. `add_timing` is the loop's timing observer."""

    def __init__(self, address: str, info: EngineInfo) -> None:
        self._info = info
        self._codec = Codec()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.bind(address)
        self._sinks: dict[bytes, ClientSink] = {}  # every API process seen
        self._batches: dict[bytes, CoreBatch] = {}
        self._timings: list[RequestTiming] = []
        self._snapshot: EngineSnapshot | None = None
        self._last_snapshot: EngineSnapshot | None = None
        self._snapshot_due = 0.0
        self._stop = False
        # message type -> its loop command (None: answered here, or refused)
        self._converters: dict[type, Callable[[bytes, ClientSink, Any], LoopCommand | None]] = {
            AddRequest: self._new_request,
            Abort: self._abort,
            Stop: self._stop_samples,
            CommandRequest: self._run_command,
            Hello: self._hello,
        }

    def request_stop(self) -> None:
        """End the loop after the current step (safe from a signal handler)."""
        self._stop = True

    def add_timing(self, timing: RequestTiming) -> None:
        self._timings.append(timing)

    def batch(self, client: bytes) -> CoreBatch:
        """What goes to `client` at the next flush."""
        batch = self._batches.get(client)
        if batch is None:
            batch = self._batches[client] = CoreBatch()
        return batch

    # -- the transport ---------------------------------------------------------------------

    def receive(self, block: bool) -> Sequence[LoopCommand]:
        if self._stop:
            return (Shutdown(),)
        if block and not self._socket.poll(IDLE_POLL_MS):
            return (Shutdown(),) if self._stop else ()
        commands: list[LoopCommand] = []
        while True:
            try:
                client, data = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            sink = self._sinks.get(client)
            if sink is None:
                sink = self._sinks[client] = ClientSink(self, client)
            try:
                message = self._codec.decode_client(data)
            except msgspec.ValidationError as error:
                refused = refusal(data, error)
                if refused is None:
                    logger.exception("a malformed message from API process %r was dropped", client)
                else:
                    sink.refused(*refused)
                continue
            except msgspec.DecodeError:
                logger.exception("a malformed message from API process %r was dropped", client)
                continue
            command = self._converters[type(message)](client, sink, message)
            if command is not None:
                commands.append(command)
        if self._stop:
            commands.append(Shutdown())
        return commands

    def _new_request(
        self, client: bytes, sink: ClientSink, message: AddRequest
    ) -> LoopCommand | None:
        try:
            lora_request = lora_from_wire(message.lora)
        except (ValueError, TypeError) as error:
            sink.refused(message.request_id, error)
            return None
        return NewRequest(
            message.request_id,
            message.prompt,
            message.params,
            message.prompt_token_ids,
            message.tenant,
            lora_request,
            message.arrival,
            sink,
            message.reservation,
        )

    def _abort(self, client: bytes, sink: ClientSink, message: Abort) -> LoopCommand:
        return AbortRequests(tuple(message.request_ids))

    def _stop_samples(self, client: bytes, sink: ClientSink, message: Stop) -> LoopCommand:
        return StopSamples(tuple(message.hits))

    def _run_command(
        self, client: bytes, sink: ClientSink, message: CommandRequest
    ) -> LoopCommand | None:
        try:
            command = self._codec.command_of(message)
        except (ValueError, msgspec.DecodeError) as error:
            self.batch(client).results.append(CommandResult(message.seq, error=error_info(error)))
            return None
        future: concurrent.futures.Future = concurrent.futures.Future()

        def answer(done: concurrent.futures.Future) -> None:
            error = done.exception()
            result = (
                CommandResult(message.seq, error=error_info(error))
                if error is not None
                else self._codec.result(message.seq, done.result())
            )
            self.batch(client).results.append(result)

        future.add_done_callback(answer)
        return RunCommand(command, future)

    def _hello(self, client: bytes, sink: ClientSink, message: Hello) -> None:
        if message.version != PROTOCOL_VERSION:
            logger.error(
                "API process %r speaks protocol %d, the engine %d",
                client,
                message.version,
                PROTOCOL_VERSION,
            )
        self._socket.send_multipart([client, self._codec.encode(self._info)])
        # A new client gets the gauges at once.
        self.batch(client).snapshot = self._snapshot

    def flush(self, snapshot: EngineSnapshot, idle: bool, force_snapshot: bool = False) -> None:
        self._snapshot = snapshot
        now = time.monotonic()
        published = None
        timings, self._timings[:] = list(self._timings), []
        # NOTE: the gauges go out at most every SNAPSHOT_INTERVAL_S while the engine is busy,
        # and at once with a finished request or when it goes idle, so a client that reads
        # /metrics after its response sees the counts that include it.
        due = force_snapshot or timings or now >= self._snapshot_due
        if snapshot != self._last_snapshot and (due or idle):
            published = self._last_snapshot = snapshot
            self._snapshot_due = now + SNAPSHOT_INTERVAL_S
        if timings or published is not None:
            for client in self._sinks:
                batch = self.batch(client)
                batch.timings.extend(timings)
                batch.snapshot = published or batch.snapshot
        batches, self._batches = self._batches, {}
        for client, batch in batches.items():
            try:
                self._socket.send_multipart([client, self._codec.encode(batch)], zmq.NOBLOCK)
            except zmq.ZMQError:
                logger.warning("could not send to API process %r; dropped its batch", client)

    def drain(self) -> Sequence[LoopCommand]:
        # NOTE: messages still in the socket are not read: the API processes learn of the
        # core's end from the launcher and fail what they sent.
        return ()

    def close(self, snapshot: EngineSnapshot) -> None:
        self.flush(snapshot, idle=True, force_snapshot=True)
        self._socket.close()
        self._context.term()
