"""A real uvicorn server on a free loopback port, over the embedded model, for the API tests."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from loraplex.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tests.waiting import wait_until

MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 512


@dataclass(frozen=True)
class LiveServer:
    base_url: str  # e.g. http://127.0.0.1:41234
    engine: object  # the InprocClient behind it
    model: str  # the served model name

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(
            model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, device="cpu"
        ),
        cache=CacheConfig(num_kv_blocks=NUM_KV_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=64),
    )


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    """The app over an InprocClient (the engine on a thread of this process); with LORAPLEX_TEST_API_SERVER_COUNT=N set, the
    `loraplex serve` processes instead (an engine core and N API processes), so every test
    that uses this fixture runs against the multi-process server."""
    count = os.environ.get("LORAPLEX_TEST_API_SERVER_COUNT")
    if count:
        from process_server import launch

        served = launch(model_dir, tmp_path_factory.mktemp("serve") / "serve.log", int(count))
        yield served  # type: ignore[misc]
        served.stop()
        return
    import uvicorn

    from loraplex.platform.api.app import build_app
    from loraplex.platform.api.settings import ServerSettings
    from loraplex.platform.engine.inproc_client import InprocClient

    port = _free_port()
    engine = InprocClient(engine_config(model_dir))
    app = build_app(engine, ServerSettings(port=port, disconnect_poll_s=0.1))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    wait_until(lambda: uv.started or not thread.is_alive(), 60, "the test server to start")
    if not uv.started:
        raise RuntimeError("the test server's thread ended before it started")
    yield LiveServer(base_url, engine, engine.served_model_name)
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="session")
def offline_llm(model_dir):
    """The offline API on the same model and settings, to compare outputs against."""
    from loraplex import LLM

    return LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=64,
    )
