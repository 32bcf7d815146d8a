"""The serving launcher: one EngineCore process, then `--api-server-count` API processes on one
listening socket, supervised until a signal or a death.

Order: bind the port (so a taken port fails at once), start the engine core, wait for its
handshake (the model is loaded), then start the API processes: no API process answers /health
before the engine runs. Then:

- SIGTERM / SIGINT: the API processes drain (up to `shutdown_timeout_s`, then a 503 error
  event ends what still runs), exit; then the engine core stops. Exit status 0.
- The engine core dies: every API process fails its requests in flight with 503s and answers
  /health with 503 for `ENGINE_DEATH_GRACE_S`, then everything exits with status 1. The server
  does not restart the engine: a supervisor (systemd, Kubernetes) restarts the server.
- An API process dies: the others and the engine are stopped; exit status 1.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as EventType
from typing import Any

from loraplex.config import EngineConfig
from loraplex.entrypoints.api_server import run_api_server
from loraplex.platform.api.settings import ServerSettings
from loraplex.platform.engine.core_client import EngineCoreClient, default_address
from loraplex.platform.engine.core_process import STARTUP_REFUSED_EXIT, run_engine_core

logger = logging.getLogger(__name__)

ENGINE_DEATH_GRACE_S = 2.0  # /health answers 503 this long after the engine died
ENGINE_STOP_TIMEOUT_S = 30.0  # the engine core's time to stop after SIGTERM
ENGINE_START_TIMEOUT_S = 3600.0  # the longest model load waited for


# The default number of API processes: one per CORES_PER_API_SERVER cores the launcher may run
# on, at least one and at most MAX_DEFAULT_API_SERVERS. Tenants' caps hold across them (the
# engine core counts them). One API process streams 256 streams at a fraction of a core
# (`benchmarks/api_process.py`); more of them take requests' own work (bodies, templates,
# tokenization) in parallel, so a burst of arrivals is admitted sooner, and leave cores to the
# engine core and its tensor-parallel ranks.
CORES_PER_API_SERVER = 4
MAX_DEFAULT_API_SERVERS = 4
API_SERVER_COUNT_RULE = (
    f"min({MAX_DEFAULT_API_SERVERS}, max(1, usable cores // {CORES_PER_API_SERVER}))"
)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_api_server_count(cores: int | None = None) -> int:
    """`--api-server-count` when not given: API_SERVER_COUNT_RULE over `cores` (default: the
    usable cores), e.g. 1 on 2-7 cores, 2 on 8-11, 4 on 16 or more."""
    cores = usable_cores() if cores is None else cores
    return min(MAX_DEFAULT_API_SERVERS, max(1, cores // CORES_PER_API_SERVER))


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket every API process accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


def ready_line(host: str, port: int) -> str:
    """What the launcher logs once every API process serves: the line to wait for (README)."""
    return f"loraplex is ready on http://{host}:{port} (Ctrl-C to stop)"


class Launcher:
    """Starts and supervises the processes of one server."""

    def __init__(
        self,
        config: EngineConfig,
        settings: ServerSettings,
        api_server_count: int,
        shutdown_timeout_s: float,
        uvicorn_options: dict[str, Any],
    ) -> None:
        if api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {api_server_count}")
        if shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {shutdown_timeout_s}")
        if settings.runtime_lora_updating and api_server_count > 1:
            # NOTE: each API process keeps its own table of server-wide adapter names, so one
            # loaded through one process would be unknown to the others.
            raise ValueError(
                "runtime LoRA updating (--allow-runtime-lora-updating, "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs --api-server-count 1: each API process "
                "keeps its own list of server-wide adapters"
            )
        self.config = config
        self.settings = settings
        self.api_server_count = api_server_count
        self.shutdown_timeout_s = shutdown_timeout_s
        self.uvicorn_options = uvicorn_options
        self._context = multiprocessing.get_context("spawn")
        self._stopping = False
        self.engine: BaseProcess | None = None
        self.api_servers: list[BaseProcess] = []

    def run(self) -> int:
        """Serve until a signal (0) or a process death (1)."""
        listener = bind_listener(self.settings.host, self.settings.port)
        address = default_address()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM,
                                                                          signal.SIGINT)}  # fmt: skip
        try:
            refusals, refusals_writer = self._context.Pipe(duplex=False)
            self.engine = self._context.Process(
                target=run_engine_core,
                args=(self.config, address, refusals_writer),
                name="loraplex-engine-core",
            )
            self.engine.start()
            refusals_writer.close()
            if not self._wait_for_engine(address):
                if self.engine.exitcode == STARTUP_REFUSED_EXIT and refusals.poll():
                    # NOTE: a refused model or option: `loraplex serve` prints it, exit 2
                    raise ValueError(refusals.recv())
                return 1
            ready = [self._context.Event() for _ in range(self.api_server_count)]
            for index in range(self.api_server_count):
                process = self._context.Process(
                    target=run_api_server,
                    args=(self.settings, listener, address, self.uvicorn_options,
                          self.shutdown_timeout_s, os.getpid(), ready[index]),
                    name=f"loraplex-api-{index}",
                )  # fmt: skip
                process.start()
                self.api_servers.append(process)
            listener.close()
            logger.info(
                "starting on http://%s:%d: engine core %d, API processes %s",
                self.settings.host,
                self.settings.port,
                self.engine.pid,
                [p.pid for p in self.api_servers],
            )
            return self._supervise(ready)
        finally:
            listener.close()
            self._stop_all()
            self._remove_socket_file(address)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: object) -> None:
        self._stopping = True

    def _wait_for_engine(self, address: str) -> bool:
        """Wait for the engine core's handshake; False if it died or a signal came first."""
        assert self.engine is not None
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping:
            if not self.engine.is_alive():
                logger.error("the engine core exited with %s while starting", self.engine.exitcode)
                return False
            try:
                EngineCoreClient.probe(address, timeout_s=1.0)
                return True
            except TimeoutError:
                continue
        return False

    def _supervise(self, ready: Sequence[EventType]) -> int:
        assert self.engine is not None
        processes = [self.engine, *self.api_servers]
        announced = False
        while not self._stopping:
            multiprocessing.connection.wait([p.sentinel for p in processes], timeout=0.2)
            if self._stopping:
                break
            if not announced and all(event.is_set() for event in ready):
                announced = True
                logger.info("%s", ready_line(self.settings.host, self.settings.port))
            if not self.engine.is_alive():
                logger.error("the engine core died (exit code %s)", self.engine.exitcode)
                self._signal(self.api_servers, signal.SIGUSR1)
                time.sleep(ENGINE_DEATH_GRACE_S)
                return 1
            dead = [p for p in self.api_servers if not p.is_alive()]
            if dead:
                logger.error("API process %s died (exit code %s)", dead[0].pid, dead[0].exitcode)
                return 1
        return 0

    def _stop_all(self) -> None:
        """API processes first (they drain), then the engine core; no process outlives this."""
        self._signal(self.api_servers, signal.SIGTERM)
        drain_deadline = time.monotonic() + self.shutdown_timeout_s + 10.0
        for process in self.api_servers:
            process.join(max(0.0, drain_deadline - time.monotonic()))
        if self.engine is not None:
            self._signal([self.engine], signal.SIGTERM)
            self.engine.join(ENGINE_STOP_TIMEOUT_S)
        for process in [*self.api_servers, *([self.engine] if self.engine else [])]:
            if process.is_alive():
                logger.error("%s did not stop; killing it", process.name)
                process.kill()
                process.join(5)

    @staticmethod
    def _signal(processes: Sequence[BaseProcess], sig: int) -> None:
        for process in processes:
            if process.pid is not None and process.is_alive():
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    @staticmethod
    def _remove_socket_file(address: str) -> None:
        if address.startswith("ipc://"):
            try:
                os.unlink(address.removeprefix("ipc://"))
            except OSError:
                pass
