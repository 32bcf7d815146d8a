"""The EngineCore process: the Engine in a process of its own, serving API processes over ZeroMQ.

It owns the device and does nothing but steps and the messages between them: an `EngineLoop`
(commands between steps, the watchdog, recovery from a failed step, timings) over a
`ZmqTransport` (a ROUTER socket each API process connects a DEALER socket to), on the process's
main thread. Per step each API process gets one `CoreBatch` with its requests' outputs, and
every process gets the timings of every finished request.

The core handles token ids only (its Engine runs with `detokenize=False`): its outputs carry each
step's new token ids and logprob values, without text or the prompt. The API processes
detokenize, match stop strings and send `Stop` for a sample that matched one, which the core
ends as finished by that stop string.

SIGTERM ends the loop: requests still in flight fail with EngineDeadError, which their API
processes answer with 503s. SIGINT is ignored: on Ctrl-C the launcher drains the API processes
first, then stops the core.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

from loraplex.config import EngineConfig
from loraplex.platform.engine.engine import Engine
from loraplex.platform.engine.engine_loop import EngineLoop
from loraplex.platform.engine.gc_tuning import freeze_startup_heap
from loraplex.platform.engine.ipc import PROTOCOL_VERSION, EngineInfo
from loraplex.platform.engine.warm_up import should_warm_up, warm_up
from loraplex.platform.engine.zmq_transport import ZmqTransport
from loraplex.platform.runner.cpu_malloc import configure_cpu_malloc
from loraplex.platform.runner.cpu_threads import configure_cpu_threads
from loraplex.platform.runner.model_runner import resolve_device
from loraplex.platform.runner.tp.workers import set_worker_death_handler

logger = logging.getLogger(__name__)


def engine_info(engine: Engine) -> EngineInfo:
    """What an API process learns of the engine in the handshake."""
    return EngineInfo(
        version=PROTOCOL_VERSION,
        served_model_name=engine.served_model_name,
        max_model_len=engine.max_model_len,
        model_dir=str(engine.model_dir),
        vocab_size=engine.runner.arch.vocab_size,
        pid=os.getpid(),
        adapter_validator=engine.adapter_validator,
        generation_defaults=engine.generation_defaults,
    )


def build_engine_core(config: EngineConfig, address: str) -> tuple[EngineLoop, ZmqTransport]:
    """The engine, and its loop over a transport bound to `address` (e.g. ipc:///tmp/x)."""
    engine = Engine(config, detokenize=False)
    try:
        transport = ZmqTransport(address, engine_info(engine))
    except BaseException:
        engine.shutdown()
        raise
    loop = EngineLoop(engine, transport)
    loop.add_timing_observer(transport.add_timing)
    return loop, transport


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
    started = time.monotonic()
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
            configure_cpu_malloc()  # NOTE: process-wide, so only where the engine owns its process
        loop, transport = build_engine_core(config, address)
    except (ValueError, FileNotFoundError) as exc:
        if refusals is None:
            raise
        refusals.send(str(exc))
        sys.exit(STARTUP_REFUSED_EXIT)
    signal.signal(signal.SIGTERM, lambda *_: transport.request_stop())
    engine = loop.engine
    logger.info("engine core %d serving %s on %s", os.getpid(), engine.served_model_name, address)
    engine.structured.prepare()  # the grammar compiler, before the first request needs it
    # NOTE: before the loop answers any API process's handshake: none starts (so /health does
    # not answer) until the engine is warm.
    if should_warm_up(engine.runner.device.type):
        warm_up(engine)
    freeze_startup_heap()
    logger.info("engine core ready %.1f s after its start", time.monotonic() - started)
    loop.run()
