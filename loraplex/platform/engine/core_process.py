"""EngineCore: the Engine in a process of its own, serving API processes over ZeroMQ.

It owns the device and does nothing but steps and the messages between them: the AsyncEngine's
engine-thread loop (commands between steps, the watchdog, recovery from a failed step, timing)
run on the process's main thread, its command queue replaced by a ROUTER socket. Each API
process connects a DEALER socket; per step the core sends each one a single `CoreBatch` with its
requests' outputs, and sends every process the timings of every finished request, so each API
process's metrics describe the whole server.

The core handles token ids only: its outputs carry each step's new token ids and logprob
values, without text or the prompt. The API processes detokenize, match stop strings and send
`Stop` for a sample that matched one, which the core ends as finished by that stop string.

SIGTERM (or a `Shutdown` from the launcher) ends the loop: requests still in flight fail with
EngineDeadError, which their API processes answer with 503s. SIGINT is ignored: on Ctrl-C the
launcher drains the API processes first, then stops the core.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from loraplex.config import EngineConfig
from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.core.timing import RequestTiming
from loraplex.platform.engine.async_engine import _ACCEPTED, AsyncEngine, _Add
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
    params_from_wire,
)
from loraplex.platform.runner.cpu_threads import configure_cpu_threads
from loraplex.platform.runner.model_runner import resolve_device
from loraplex.platform.runner.tp.workers import set_worker_death_handler

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # how long an idle core waits for a message before it looks around again


@dataclass
class _RemoteAdd(_Add):
    """An add request from one API process (`client`: its ZeroMQ routing id)."""

    client: bytes = b""
    acked: bool = False


class EngineCore(AsyncEngine):
    """The engine loop of the EngineCore process, bound to `address` (e.g. ipc:///tmp/x)."""

    def __init__(self, config: EngineConfig, address: str) -> None:
        super().__init__(config, detokenize=False)
        self._codec = Codec()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.bind(address)
        self._clients: set[bytes] = set()
        self._batches: dict[bytes, CoreBatch] = {}
        self._timings: list[RequestTiming] = []
        self._last_snapshot: EngineSnapshot | None = None
        self._snapshot_due = 0.0
        self._stop = False
        self.add_timing_observer(self._timings.append)

    def request_stop(self) -> None:
        """End the loop after the current step (safe from a signal handler)."""
        self._stop = True

    def run(self) -> None:
        """Serve until stopped; the engine is shut down on return."""
        self.engine.structured.prepare()  # as `start` does in process
        try:
            self._run()
        finally:
            self._flush(force_snapshot=True)
            self._socket.close()
            self._context.term()

    # -- AsyncEngine's hooks --------------------------------------------------------------

    def _handle_commands(self, block: bool) -> bool:
        if self._stop:
            return False
        if block and not self._socket.poll(IDLE_POLL_MS):
            return not self._stop
        received = False
        while True:
            try:
                client, data = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if received:
                    # NOTE: acknowledgements and command results go out now, not after the
                    # step: a request of many prompts adds them one ack at a time.
                    self._flush()
                return not self._stop
            received = True
            self._clients.add(client)
            try:
                message = self._codec.decode_client(data)
            except msgspec.DecodeError:
                logger.exception("a malformed message from API process %r was dropped", client)
                continue
            self._dispatch(client, message)

    def _deliver(self, command: _Add, item: object) -> None:  # type: ignore[override]
        assert isinstance(command, _RemoteAdd)
        batch = self._batch(command.client)
        if item is _ACCEPTED:
            command.acked = True
            batch.acks.append(AddResult(command.request_id))
        elif isinstance(item, BaseException):
            if command.acked:
                batch.failures.append(RequestFailure(command.request_id, error_info(item)))
            else:
                batch.acks.append(AddResult(command.request_id, error_info(item)))
        else:
            # NOTE: the API process holds the prompt; only what is new crosses (`_observe`
            # has read the prompt's length already).
            item.prompt, item.prompt_token_ids = None, []  # type: ignore[attr-defined]
            batch.outputs.append(item)  # type: ignore[arg-type]

    def _take_snapshot(self) -> EngineSnapshot:
        snapshot = super()._take_snapshot()
        # NOTE: the end of every loop pass: send what this pass produced, one batch per client.
        if hasattr(self, "_socket"):
            self._snapshot = snapshot
            self._flush()
        return snapshot

    # -- messages --------------------------------------------------------------------------

    def _dispatch(self, client: bytes, message: object) -> None:
        if isinstance(message, AddRequest):
            self._add_remote(client, message)
        elif isinstance(message, Abort):
            for request_id in message.request_ids:
                self._abort(request_id)
        elif isinstance(message, Stop):
            self._stop_samples(message)
        elif isinstance(message, CommandRequest):
            self._batch(client).results.append(self._command(message))
        elif isinstance(message, Hello):
            self._hello(client, message)

    def _add_remote(self, client: bytes, message: AddRequest) -> None:
        command = _RemoteAdd(
            message.request_id,
            message.prompt,
            None,  # type: ignore[arg-type]
            message.prompt_token_ids,
            message.tenant,
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            message.arrival,
            client=client,
        )
        try:
            command.params = params_from_wire(message.params)
            command.lora_request = lora_from_wire(message.lora)
        except (ValueError, TypeError) as error:
            self._deliver(command, error)
            return
        self._add(command)

    def _stop_samples(self, message: Stop) -> None:
        """End the samples an API process found a stop string in (finish reason "stop")."""
        now = time.monotonic()
        for output in self.engine.stop_samples(message.hits):
            live = self._live.get(output.request_id)
            if live is None:
                continue
            if output.finished:
                del self._live[output.request_id]
                self._observe(live, output, now)
            self._deliver(live.command, output)

    def _command(self, message: CommandRequest) -> CommandResult:
        try:
            command = self._codec.command_of(message)
            value = self.engine.handle_command(command)
        except Exception as error:
            return CommandResult(message.seq, error=error_info(error))
        return self._codec.result(message.seq, value)

    def _hello(self, client: bytes, message: Hello) -> None:
        engine = self.engine
        info = EngineInfo(
            version=PROTOCOL_VERSION,
            served_model_name=self.served_model_name,
            max_model_len=self.max_model_len,
            model_dir=str(engine.model_dir),
            vocab_size=engine.runner.arch.vocab_size,
            pid=os.getpid(),
            adapter_validator=self.adapter_validator,
            generation_defaults=engine.generation_defaults,
        )
        if message.version != PROTOCOL_VERSION:
            logger.error(
                "API process %r speaks protocol %d, the engine %d",
                client,
                message.version,
                PROTOCOL_VERSION,
            )
        self._socket.send_multipart([client, self._codec.encode(info)])
        # A new client gets the gauges at once.
        self._batch(client).snapshot = self._snapshot

    # -- sending ---------------------------------------------------------------------------

    def _batch(self, client: bytes) -> CoreBatch:
        batch = self._batches.get(client)
        if batch is None:
            batch = self._batches[client] = CoreBatch()
        return batch

    def _flush(self, force_snapshot: bool = False) -> None:
        now = time.monotonic()
        snapshot = None
        timings, self._timings[:] = list(self._timings), []
        # NOTE: the gauges go out at most every SNAPSHOT_INTERVAL_S while the engine is busy,
        # and at once with a finished request or when it goes idle, so a client that reads
        # /metrics after its response sees the counts that include it.
        due = force_snapshot or timings or now >= self._snapshot_due
        if self._snapshot != self._last_snapshot and (
            due or not self.engine.has_unfinished_requests()
        ):
            snapshot = self._last_snapshot = self._snapshot
            self._snapshot_due = now + SNAPSHOT_INTERVAL_S
        if timings or snapshot is not None:
            for client in self._clients:
                batch = self._batch(client)
                batch.timings.extend(timings)
                batch.snapshot = snapshot or batch.snapshot
        batches, self._batches = self._batches, {}
        for client, batch in batches.items():
            try:
                self._socket.send_multipart([client, self._codec.encode(batch)], zmq.NOBLOCK)
            except zmq.ZMQError:
                logger.warning("could not send to API process %r; dropped its batch", client)


def _exit_on_worker_death(reason: str) -> None:
    logger.error("engine core exiting: %s", reason)
    logging.shutdown()
    os._exit(1)


# The engine core's exit status when its model or options are refused at start-up (a
# ValueError or FileNotFoundError): the launcher reports the message sent before it.
STARTUP_REFUSED_EXIT = 2


def run_engine_core(config: EngineConfig, address: str, refusals: Connection | None = None) -> None:
    """The EngineCore process's entry point (a multiprocessing target). A model or option the
    engine refuses at start-up is sent on `refusals` as its message, and the process exits with
    STARTUP_REFUSED_EXIT (no traceback: it is the user's input, not a crash)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # NOTE: a tensor-parallel rank that dies ends this process at once with status 1 (a step
    # may be waiting on it in a collective); the API processes then answer 503 and exit, as
    # when the engine core itself dies.
    set_worker_death_handler(_exit_on_worker_death)
    try:
        if resolve_device(config.model.device).type == "cpu":
            # NOTE: before the model loads, so every thread the core starts inherits the binding
            configure_cpu_threads(
                own_process=True, tensor_parallel_size=config.parallel.tensor_parallel_size
            )
        core = EngineCore(config, address)
    except (ValueError, FileNotFoundError) as exc:
        if refusals is None:
            raise
        refusals.send(str(exc))
        sys.exit(STARTUP_REFUSED_EXIT)
    signal.signal(signal.SIGTERM, lambda *_: core.request_stop())
    logger.info("engine core %d serving %s on %s", os.getpid(), core.served_model_name, address)
    core.run()
