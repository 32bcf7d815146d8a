"""Upload-to-first-token latency of a new rank-16 adapter, on CPU with the embedded model.

A live server (uvicorn in this process, a fresh data folder, one tenant); for each of --repeats
fresh PEFT adapters (random A and B, rank 16, all seven projections): POST /v1/adapters, then
stream one completion on it and time its first token. The baseline is the same request on the
base model. Writes benchmarks/results/cpu_adapter_upload.json.

    python -m benchmarks.cpu_adapter_upload --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from benchmarks.record import write_result

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Write one sentence about the sea."


def start_server(data_dir: Path, admin_key: str):
    import uvicorn

    from loraplex.config import EngineConfig, ModelConfig
    from loraplex.platform.api.app import build_app
    from loraplex.platform.api.state import ServerSettings
    from loraplex.platform.engine.async_engine import AsyncEngine

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = AsyncEngine(EngineConfig(model=ModelConfig(device="cpu", max_model_len=1024)))
    settings = ServerSettings(port=port, data_dir=str(data_dir), admin_key=admin_key)
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, settings), host="127.0.0.1", port=port, log_level="error")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, engine, f"http://127.0.0.1:{port}"


def make_adapter(base, folder: Path, seed: int, rank: int) -> tuple[Path, int]:
    """A PEFT adapter with random non-zero weights; returns (folder, bytes on disk)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=MODULES, init_lora_weights=False)
    model = get_peft_model(base, config)
    model.save_pretrained(str(folder))
    model.unload()
    return folder, sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def first_token_s(client: httpx.Client, model: str | None) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True, "temperature": 0}
    start = time.monotonic()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - start
    raise RuntimeError("no token streamed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from loraplex.platform.models.model_store import ensure_default_model

    model_dir = ensure_default_model(progress=False)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    work = Path(tempfile.mkdtemp(prefix="loraplex-upload-bench-"))
    server, engine, url = start_server(work / "data", "sk-bench-admin")
    admin = httpx.Client(base_url=url, headers={"Authorization": "Bearer sk-bench-admin"})
    key = admin.post("/admin/tenants", json={"name": "bench"}).json()["api_key"]
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    first_token_s(client, None)  # warm-up
    base_ttft = statistics.median(first_token_s(client, None) for _ in range(args.repeats))
    uploads, ttfts, totals, sizes = [], [], [], []
    for i in range(args.repeats):
        folder, size = make_adapter(base, work / f"adapter{i}", seed=i, rank=args.rank)
        files = [("files", (f.name, f.read_bytes())) for f in sorted(folder.iterdir())
                 if f.name in ("adapter_config.json", "adapter_model.safetensors")]  # fmt: skip
        start = time.monotonic()
        client.post("/v1/adapters", data={"name": f"a{i}"}, files=files).raise_for_status()
        uploaded = time.monotonic()
        ttft = first_token_s(client, f"a{i}")
        uploads.append(uploaded - start)
        ttfts.append(ttft)
        totals.append(uploaded - start + ttft)
        sizes.append(size)
    server.should_exit = True
    shutil.rmtree(work, ignore_errors=True)
    write_result(
        "cpu_adapter_upload.json",
        "adapter upload to first token (CPU, embedded SmolLM2-135M, fp32)",
        {
            "upload_to_first_token_s_median": statistics.median(totals),
            "upload_s_median": statistics.median(uploads),
            "first_token_after_upload_s_median": statistics.median(ttfts),
            "adapter_bytes": statistics.median(sizes),
        },
        {"base_model_first_token_s_median": base_ttft},
        rank=args.rank,
        target_modules=MODULES,
        repeats=args.repeats,
        totals_s=totals,
    )


if __name__ == "__main__":
    main()
