"""ThreadTransport: an EngineLoop's transport to asyncio callers in the same process.

Callers on any thread put loop commands on a queue; the loop's thread takes them between steps.
Each request's answers go back to the caller's asyncio.Queue on the caller's event loop
(`loop.call_soon_threadsafe`), as they are produced: there is nothing to flush.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Sequence

from loraplex.platform.core.stats import EngineSnapshot
from loraplex.platform.engine.loop_commands import LoopCommand, Shutdown
from loraplex.platform.engine.request_stream import ACCEPTED, StreamItem


class QueueSink:
    """One request's answers, put on its caller's asyncio.Queue from the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue[StreamItem]) -> None:
        self._loop = loop
        self._outputs = outputs

    def accepted(self, request_id: str) -> None:
        self.output(ACCEPTED)

    def refused(self, request_id: str, error: BaseException) -> None:
        self.output(error)

    def output(self, output: StreamItem) -> None:
        """Put `output` on the request's queue: an output, or what the other methods pass."""
        try:
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, output)
        except RuntimeError:
            # NOTE: the caller's event loop has closed; nobody is left to read this answer.
            pass

    def failed(self, request_id: str, error: BaseException) -> None:
        self.output(error)


class ThreadTransport:
    """Commands from any thread to the loop's thread, through a queue."""

    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[LoopCommand] = queue.SimpleQueue()

    def put(self, command: LoopCommand) -> None:
        """Send a command to the loop (any thread)."""
        self._commands.put(command)

    def receive(self, block: bool) -> Sequence[LoopCommand]:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return ()
        commands = [command]
        # NOTE: the commands after a Shutdown stay queued: `drain` hands them to the loop to fail.
        while not isinstance(command, Shutdown):
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            commands.append(command)
        return commands

    def flush(self, snapshot: EngineSnapshot, idle: bool) -> None:
        return None  # every answer went out when it was produced

    def drain(self) -> Sequence[LoopCommand]:
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def close(self, snapshot: EngineSnapshot) -> None:
        return None
