"""Two loraplex replicas behind Ray Serve on CPU (a tiny random Llama, one shared file://
registry): a tenant uploads an adapter through one replica and gets its outputs through the
other, equal to a single-engine run; requests on the adapter then stay on that replica."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import httpx
import pytest

from loraplex.entrypoints.ray_serve import MULTIPLEX_HEADER, REPLICA_HEADER, multiplexed_model_id
from tests.platform.api.tenant_helpers import upload

sys.path.insert(0, str(Path(__file__).parents[1] / "adapters"))
from random_adapters import write_adapter  # noqa: E402

PROMPT = [1, 17, 42, 99, 7]


def test_routing_key_is_the_model_qualified_by_the_callers_key():
    body = json.dumps({"model": "sql", "prompt": "hi"}).encode()
    assert multiplexed_model_id(body, None) == "sql"
    alpha, beta = (multiplexed_model_id(body, f"Bearer sk-{t}") for t in ("alpha", "beta"))
    assert alpha.startswith("sql#") and alpha != beta  # two tenants' "sql" are two adapters
    assert multiplexed_model_id(b"not json", None) == ""
    assert multiplexed_model_id(b'{"prompt": "no model"}', None) == ""


@pytest.fixture(scope="module")
def ray_app(tiny_llama_dir, tmp_path_factory):
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from loraplex.entrypoints.ray_serve import build_ray_app
    from loraplex.platform.api.settings import ServerSettings

    root = tmp_path_factory.mktemp("ray")
    tiny = tiny_llama_dir
    config = EngineConfig(
        model=ModelConfig(model=str(tiny), dtype="float32", max_model_len=256, device="cpu"),
        cache=CacheConfig(num_kv_blocks=64),
        lora=LoRAConfig(max_loras=2, max_cpu_loras=4),
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = ServerSettings(port=port, data_dir=str(root / "local"),
                              adapter_registry=f"file://{root / 'shared'}")  # fmt: skip
    repo = str(Path(__file__).parents[2])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": repo}})  # fmt: skip
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_ray_app(config, settings, replicas=2, num_cpus=0), route_prefix="/")
        hf_config = json.loads((tiny / "config.json").read_text())
        yield (f"http://127.0.0.1:{port}", tiny, write_adapter(root / "adapter", hf_config,
                                                             seed=5, scale=4.0))  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_upload_through_one_replica_generate_through_the_other(ray_app):
    from loraplex import LLM, SamplingParams
    from loraplex.adapters.request import LoRARequest

    base_url, tiny, folder = ray_app
    with httpx.Client(base_url=base_url, timeout=120) as client:
        # the upload carries a routing key of its own, so its replica holds one "model" and the
        # adapter's first request goes to the replica holding the fewest: the other one. NOTE:
        # a replica's models reach the router by a push (every 0.1 s); under a loaded host the
        # first adapter's request can come before it and land anywhere. Its replica then holds
        # two models, so the next adapter uploaded the same way goes to the other one.
        for attempt in range(3):
            name = f"support-{attempt}"
            client.headers[MULTIPLEX_HEADER] = "uploads"
            uploaded = upload(client, name, folder)
            assert uploaded.status_code == 201, uploaded.text
            del client.headers[MULTIPLEX_HEADER]
            body = {"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
            served = [client.post("/v1/completions", json=body) for _ in range(3)]
            assert all(r.status_code == 200 for r in served), served[0].text
            replicas = {r.headers[REPLICA_HEADER] for r in served}
            assert replicas == {served[0].headers[REPLICA_HEADER]}  # the adapter stays there
            if served[0].headers[REPLICA_HEADER] != uploaded.headers[REPLICA_HEADER]:
                break
    assert served[0].headers[REPLICA_HEADER] != uploaded.headers[REPLICA_HEADER]
    llm = LLM(str(tiny), dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=64)
    single = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                          lora_request=LoRARequest("support", str(folder)))  # fmt: skip
    assert {r.json()["choices"][0]["text"] for r in served} == {single[0].outputs[0].text}
