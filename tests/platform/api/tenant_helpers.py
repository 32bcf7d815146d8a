"""Helpers of the multi-tenant API tests: a live server over a data folder, PEFT adapters for the
embedded model, and PEFT's own greedy output to compare against."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.grammar.config import GrammarConfig
from tests.waiting import wait_until

ADMIN_KEY = "sk-admin-test"
MODULES = ["q_proj", "v_proj", "down_proj"]


class IdleEngine:
    """What `build_app` touches of an engine before start-up (its lifespan is not run): for
    tests of routes that refuse a request before it reaches the engine."""

    served_model_name = "tiny"
    max_model_len = 64

    def add_timing_observer(self, observer) -> None:
        pass


@dataclass
class TenantServer:
    base_url: str
    engine: object
    model: str
    uvicorn: object
    thread: threading.Thread

    def client(self, key: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=120)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


def start_server(
    model_dir: Path,
    data_dir: Path,
    max_num_seqs: int = 8,
    grammar: GrammarConfig | None = None,
    lora: LoRAConfig | None = None,
    override_generation_config: dict | None = None,
    served_model_name: str | None = None,
    **settings,
) -> TenantServer:
    import uvicorn

    from loraplex.platform.api.app import build_app
    from loraplex.platform.api.read_deadlines import uvicorn_options
    from loraplex.platform.api.settings import ServerSettings
    from loraplex.platform.engine.inproc_client import InprocClient

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = EngineConfig(
        model=ModelConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=512,
            device="cpu",
            override_generation_config=override_generation_config,
            served_model_name=served_model_name,
        ),  # fmt: skip
        cache=CacheConfig(num_kv_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        grammar=grammar or GrammarConfig(),
        lora=lora or LoRAConfig(),
    )
    engine = InprocClient(config)
    settings.setdefault("admin_key", ADMIN_KEY)
    server_settings = ServerSettings(port=port, data_dir=str(data_dir), **settings)
    app = build_app(engine, server_settings)
    # NOTE: with the connection timeouts `loraplex serve` sets (read_deadlines)
    options = uvicorn_options(server_settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 60, "the test server to start")
    if not server.started:
        raise RuntimeError("the test server's thread ended before it started")
    return TenantServer(
        f"http://127.0.0.1:{port}", engine, engine.served_model_name, server, thread
    )


def create_tenants(server: TenantServer, *names: str) -> dict[str, str]:
    """Create each tenant through the admin API; their API keys by name."""
    admin = server.client(ADMIN_KEY)
    keys = {}
    for name in names:
        response = admin.post("/admin/tenants", json={"name": name})
        assert response.status_code == 201, response.text
        keys[name] = response.json()["api_key"]
    return keys


def load_hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_adapter(base, folder: Path, seed: int, r: int = 8, **options) -> Path:
    """A PEFT adapter for the embedded model with random non-zero A and B (PEFT's
    `init_lora_weights=False`); `base` is left unchanged."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=options.pop("targets", MODULES),
                        init_lora_weights=False, **options)  # fmt: skip
    model = get_peft_model(base, config)
    model.save_pretrained(str(folder))
    model.unload()
    return folder


def peft_greedy(base, folder: Path | None, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by transformers (+ PEFT when `folder` is given)."""
    from peft import PeftModel

    model = base if folder is None else PeftModel.from_pretrained(base, str(folder))
    try:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
    finally:
        if folder is not None:
            model.unload()
    return out[0, len(prompt_ids) :].tolist()


def upload(client: httpx.Client, name: str, folder: Path) -> httpx.Response:
    files = [
        ("files", ("adapter_config.json", (folder / "adapter_config.json").read_bytes())),
        (
            "files",
            ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes()),
        ),
    ]
    return client.post("/v1/adapters", data={"name": name}, files=files)


def complete(
    client: httpx.Client, model: str, prompt_ids: list[int], max_tokens: int
) -> httpx.Response:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0}
    return client.post("/v1/completions", json=body)
