"""One API server process: the FastAPI app over an EngineCoreClient, served by uvicorn on a
listening socket it shares with the other API processes (the kernel spreads connections).

Signals: SIGTERM / SIGINT drain (uvicorn stops accepting, in-flight requests run on); requests
still running `shutdown_timeout_s` later end with a 503 error event (`engine_dead`, "the
server is shutting down") and the process exits. SIGUSR1 (sent by the launcher when the engine
core died) fails every request in flight with a 503 and turns /health to 503.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
from multiprocessing.synchronize import Event as EventType
from types import FrameType
from typing import Any

import uvicorn

from loraplex.platform.api.app import build_app
from loraplex.platform.api.read_deadlines import uvicorn_options as read_deadline_options
from loraplex.platform.api.settings import ServerSettings
from loraplex.platform.engine.core_client import EngineCoreClient
from loraplex.platform.engine.gc_tuning import freeze_startup_heap

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0  # how often an API process checks that its launcher still lives
DRAIN_MARGIN_S = 1.0  # time left after the grace period for error events to go out


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on its first exit signal also arms the end of the grace period:
    the engine client then fails what is still running, so streams end with an error event."""

    def __init__(
        self,
        config: uvicorn.Config,
        client: EngineCoreClient,
        grace_s: float,
        ready: EventType | None = None,
    ) -> None:
        super().__init__(config)
        self._client = client
        self._grace_s = grace_s
        self._ready = ready
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._ready is not None:  # the app's start-up ran: it serves now
            self._ready.set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGUSR1, self._engine_died)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(
                self._loop.call_later, self._grace_s, self._grace_period_over
            )

    def _grace_period_over(self) -> None:
        logger.warning("shutdown grace period over; ending the requests still running")
        self._client.mark_dead("the server is shutting down")

    def _engine_died(self) -> None:
        logger.error("the engine core died; failing every request in flight")
        self._client.mark_dead("the engine core died")


def _exit_with_parent(parent_pid: int) -> None:
    """End this process if its launcher is gone (killed without a chance to stop us)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="loraplex-parent-watch", daemon=True).start()


def run_api_server(
    settings: ServerSettings,
    listener: socket.socket,
    address: str,
    uvicorn_options: dict[str, Any],
    shutdown_timeout_s: float,
    parent_pid: int,
    ready: EventType | None = None,
) -> None:
    """An API server process's entry point (a multiprocessing target); `ready` is set once it
    serves requests (its app started)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _exit_with_parent(parent_pid)
    client = EngineCoreClient(address)
    app = build_app(client, settings)
    config = uvicorn.Config(
        app,
        timeout_graceful_shutdown=int(shutdown_timeout_s + DRAIN_MARGIN_S) + 1,
        **read_deadline_options(settings),
        **uvicorn_options,
    )
    server = _DrainingServer(config, client, shutdown_timeout_s, ready)
    freeze_startup_heap()  # NOTE: per-token garbage must not make the collector scan the imports
    server.run(sockets=[listener])
