"""Rank 0's side of tensor parallelism: the processes of ranks 1..N-1 and their pipes.

Rank 0 (the engine core, or the offline `LLM`'s process) schedules; every step it sends each
rank the same `ExecuteStep` and all ranks run the same forward pass, meeting in its
collectives. A monitor thread watches the ranks: when one dies, the others are killed (a
collective waiting on the dead rank then fails instead of hanging) and `on_worker_death` runs;
the engine-core process sets it to exit at once with status 1, so its API processes answer
503 and exit, as when the engine core itself dies. Each rank also dies with rank 0
(PR_SET_PDEATHSIG, and the end of its pipe).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from pathlib import Path

from loraplex.config import EngineConfig
from loraplex.platform.runner.tp.messages import Shutdown, WorkerReady
from loraplex.platform.runner.tp.worker import RankRunnerFactory, run_worker

logger = logging.getLogger(__name__)

#: How long rank 0 waits for a rank to start, load its shard of the model and answer.
READY_TIMEOUT_S = 1800.0
JOIN_TIMEOUT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank's process ended; the engine cannot step any more."""


_death_handler: Callable[[str], None] | None = None


def set_worker_death_handler(handler: Callable[[str], None] | None) -> None:
    """What the monitor does (after killing the other ranks) when a rank dies, given the
    reason; the engine-core process exits. Without one the next step raises WorkerDiedError."""
    global _death_handler
    _death_handler = handler


def rank_device(device_name: str, rank: int) -> str:
    """Rank `rank`'s device: its own GPU on CUDA (cuda:rank), the CPU otherwise."""
    if device_name == "cpu":
        return "cpu"
    import torch

    if device_name == "auto" and not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{rank}"


class TensorParallelWorkers:
    """The processes of ranks 1..size-1, started with `start` and driven by `send`; each
    builds its runner with `make_runner`."""

    def __init__(
        self, config: EngineConfig, model_dir: Path, make_runner: RankRunnerFactory
    ) -> None:
        size = config.parallel.tensor_parallel_size
        self.size = size
        self._dir = tempfile.mkdtemp(prefix="loraplex-tp-")
        self.init_file = os.path.join(self._dir, "rendezvous")
        self.dead: str | None = None
        self._closing = False
        on_cpu = rank_device(config.model.device, 1) == "cpu"
        # NOTE: CUDA cannot be forked into; on CPU a fork starts a rank in a fraction of a
        # second where a spawn re-imports torch (seconds per rank).
        ctx = mp.get_context("fork" if on_cpu else "spawn")
        self._pipes: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            rank_config = replace(
                config, model=replace(config.model, device=rank_device(config.model.device, rank))
            )
            proc = ctx.Process(
                target=run_worker,
                args=(
                    rank,
                    size,
                    rank_config,
                    str(model_dir),
                    self.init_file,
                    child,
                    os.getpid(),
                    make_runner,
                    on_cpu,
                ),  # fmt: skip
                name=f"loraplex-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._pipes.append(parent)
            self._procs.append(proc)
        self._monitor = threading.Thread(
            target=self._watch, name="loraplex-tp-monitor", daemon=True
        )
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def wait_ready(self) -> None:
        """Wait for every rank to load its shard; raise ValueError with the first refusal."""
        for rank, pipe in enumerate(self._pipes, start=1):
            if not pipe.poll(READY_TIMEOUT_S):
                raise WorkerDiedError(f"tensor-parallel rank {rank} did not load its model")
            try:
                ready = pipe.recv()
            except EOFError:
                raise WorkerDiedError(
                    f"tensor-parallel rank {rank} exited while loading its model"
                ) from None
            if not isinstance(ready, WorkerReady):
                raise WorkerDiedError(f"tensor-parallel rank {rank} sent {ready!r}")
            if ready.error is not None:
                raise ValueError(ready.error)

    def send(self, message: object) -> None:
        """The same message to every rank, in order with the ones before."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send_bytes(data)
            except OSError:
                raise WorkerDiedError(f"tensor-parallel rank {rank} is gone") from None

    def check(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank, proc = sentinels[ready[0]]
        proc.join(JOIN_TIMEOUT_S)
        self.dead = (
            f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {proc.exitcode}; "
            "the engine cannot run without it"
        )
        logger.error("%s", self.dead)
        self.kill()
        if _death_handler is not None:
            _death_handler(self.dead)

    def kill(self) -> None:
        """End every rank now (SIGKILL) and reap them."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(JOIN_TIMEOUT_S)

    def shutdown(self) -> None:
        """Ask every rank to exit, then make sure they have."""
        self._closing = True
        if self.dead is None:
            try:
                self.send(Shutdown())
            except WorkerDiedError:
                pass
        for proc in self._procs:
            proc.join(JOIN_TIMEOUT_S)
        self.kill()
        for pipe in self._pipes:
            pipe.close()
        try:
            os.unlink(self.init_file)
        except OSError:
            pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
