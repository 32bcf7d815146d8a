"""Upload-to-first-token latency of a new rank-16 adapter, through the live server.

A live server (uvicorn in this process, a fresh data folder, one tenant) over the embedded model
on CPU, or over random weights of a config file's architecture (e.g. Llama-3.1-8B on an H200).
For each of --repeats fresh PEFT adapters (random non-zero A and B, all seven projections,
written straight to adapter_config.json + adapter_model.safetensors with PEFT's tensor names):
POST /v1/adapters, then stream one completion on it and time its first token. The baseline is
the same request on the base model. One adapter is uploaded and queried first, untimed, so that
kernel compilation is not counted. A model without a tokenizer gets random token-id prompts.
The client is the standard library's http.client.

    python -m benchmarks.adapter_upload --repeats 3
    python -m benchmarks.adapter_upload --model configs/models/llama-3.1-8b.json --device cuda \\
        --dtype bfloat16 --out h200_adapter_upload.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchmarks.record import write_result
from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, BaseModelSpec
from loraplex.config import EngineConfig
from loraplex.platform.engine.inproc_client import InprocClient
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = "Write one sentence about the sea."
PROMPT_IDS = 16  # prompt length when the model has no tokenizer
ADMIN_KEY = "sk-bench-admin"
_SHORT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def write_adapter(
    folder: Path, spec: BaseModelSpec, rank: int, seed: int, base_name: str, dtype: torch.dtype
) -> int:
    """A PEFT LoRA folder fitting `spec`, every projection of every layer adapted, with PEFT's
    `init_lora_weights=False` draw (A and B uniform in +-1/sqrt(fan_in)); returns its bytes."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(rows: int, cols: int) -> torch.Tensor:
        bound = cols**-0.5
        return ((torch.rand(rows, cols, generator=generator) * 2 - 1) * bound).to(dtype)

    tensors: dict[str, torch.Tensor] = {}
    for layer in range(spec.num_layers):
        for module in MODULES:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = spec.module_shape(module)
            tensors[f"{prefix}.lora_A.weight"] = uniform(rank, in_features)  # [rank, in]
            tensors[f"{prefix}.lora_B.weight"] = uniform(out_features, rank)  # [out, rank]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": list(MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return sum((folder / name).stat().st_size for name in (CONFIG_FILE, WEIGHTS_FILE))


def multipart(fields: dict[str, str], folder: Path) -> tuple[bytes, str]:
    """A multipart/form-data body of `fields` and the adapter's two files; (body, type)."""
    boundary = uuid.uuid4().hex
    parts: list[bytes] = []
    for name, value in fields.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
        parts.append(head.encode() + value.encode() + b"\r\n")
    for filename in (CONFIG_FILE, WEIGHTS_FILE):
        head = (
            f"--{boundary}\r\nContent-Disposition: form-data; "
            f'name="files"; filename="{filename}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        )
        parts.append(head.encode() + (folder / filename).read_bytes() + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class Client:
    """A tiny HTTP client of the server (stdlib only): JSON posts, uploads, streamed TTFT."""

    def __init__(self, port: int, key: str) -> None:
        self.port = port
        self.key = key

    def _send(self, path: str, body: bytes, content_type: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        headers = {
            "Authorization": f"Bearer {self.key}",
            "Content-Type": content_type,
            "Connection": "close",
        }
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        if response.status >= 300:
            raise RuntimeError(f"POST {path}: {response.status} {response.read()[:500]!r}")
        return response

    def post_json(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        return json.loads(self._send(path, json.dumps(payload).encode(), "application/json").read())

    def upload(self, body: bytes, content_type: str) -> None:
        self._send("/v1/adapters", body, content_type).read()

    def first_token_s(self, model: str | None, prompt: str | list[int]) -> float:
        """Seconds from sending a streamed one-token completion to its first event.

        NOTE: one token, because without a tokenizer the deltas carry no text and the server
        streams nothing before the finish; with one token, the finish is the first token."""
        payload = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True,
                   "temperature": 0}  # fmt: skip
        start = time.perf_counter()
        response = self._send("/v1/completions", json.dumps(payload).encode(), "application/json")
        for line in iter(response.readline, b""):
            if line.startswith(b"data: {"):
                seconds = time.perf_counter() - start
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    raise RuntimeError(f"the completion failed: {event['error']}")
                response.read()
                return seconds
        raise RuntimeError("the completion streamed no token")


def start_server(engine: InprocClient, data_dir: Path) -> tuple[Any, threading.Thread, int]:
    """uvicorn on a free local port, on a daemon thread; returns (server, thread, port)."""
    import uvicorn

    from loraplex.platform.api.app import build_app
    from loraplex.platform.api.settings import ServerSettings

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = ServerSettings(port=port, data_dir=str(data_dir), admin_key=ADMIN_KEY)
    app = build_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server stopped while starting")
        time.sleep(0.05)
    return server, thread, port


@dataclass(frozen=True)
class Timings:
    """One run's measurements (seconds, bytes); lists have one entry per timed adapter."""

    base_first_token_s: float  # median over the base-model requests
    upload_s: list[float]
    first_token_s: list[float]
    adapter_bytes: list[int]
    warmup_total_s: float  # the untimed first adapter: upload + first token
    text_prompt: bool


def measure(engine: InprocClient, port: int, work: Path, rank: int, repeats: int,
            adapter_dtype: torch.dtype) -> Timings:  # fmt: skip
    """Create a tenant, time base-model first tokens, then upload-and-query fresh adapters."""
    spec = engine.adapter_validator.spec
    base_name = spec.name_or_path or engine.served_model_name
    vocab = engine.engine.runner.arch.vocab_size
    text_prompt = not isinstance(engine.tokenizer, TokenIdsOnlyTokenizer)
    rng = random.Random(0)

    def prompt() -> str | list[int]:
        return (
            PROMPT if text_prompt else [rng.randrange(100, vocab - 100) for _ in range(PROMPT_IDS)]
        )

    key = Client(port, ADMIN_KEY).post_json("/admin/tenants", {"name": "bench"})["api_key"]
    client = Client(port, key)
    client.first_token_s(None, prompt())  # warm-up
    base = statistics.median(client.first_token_s(None, prompt()) for _ in range(repeats))

    def upload_then_first_token(i: int) -> tuple[float, float, int]:
        folder = work / f"adapter{i}"
        size = write_adapter(folder, spec, rank, i, base_name, adapter_dtype)
        body, content_type = multipart({"name": f"a{i}"}, folder)
        start = time.perf_counter()
        client.upload(body, content_type)
        upload_s = time.perf_counter() - start
        return upload_s, client.first_token_s(f"a{i}", prompt()), size

    warm_upload, warm_first, _ = upload_then_first_token(repeats)
    runs = [upload_then_first_token(i) for i in range(repeats)]
    return Timings(
        base_first_token_s=base,
        upload_s=[r[0] for r in runs],
        first_token_s=[r[1] for r in runs],
        adapter_bytes=[r[2] for r in runs],
        warmup_total_s=warm_upload + warm_first,
        text_prompt=text_prompt,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder or config file "
                        "(random weights); default: the embedded SmolLM2-135M")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU), bfloat16, ...")
    parser.add_argument("--adapter-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype of the adapter file (PEFT saves fp32 by default)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 1024 on CPU, 4096 on CUDA")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", default=None, help="default: {cpu,gpu}_adapter_upload.json")
    args = parser.parse_args()
    on_cpu = args.device == "cpu"
    if args.repeats < 1 or args.rank < 1:
        raise ValueError(f"--repeats and --rank must be >= 1, got {args.repeats}, {args.rank}")
    if not on_cpu and not torch.cuda.is_available():
        print("benchmarks.adapter_upload --device cuda needs a CUDA GPU; skipped")
        return 0

    config = EngineConfig.from_options(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len or (1024 if on_cpu else 4096),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_lora=True,
        max_lora_rank=args.rank,
        seed=0,
    )
    load_before = os.getloadavg()[0]  # other work on the host skews CPU figures
    t0 = time.perf_counter()
    engine = InprocClient(config)
    startup_s = time.perf_counter() - t0
    work = Path(tempfile.mkdtemp(prefix="loraplex-upload-bench-"))
    server, thread, port = start_server(engine, work / "data")
    try:
        t = measure(engine, port, work, args.rank, args.repeats, getattr(torch, args.adapter_dtype))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        shutil.rmtree(work, ignore_errors=True)

    runner = engine.engine.runner
    totals = [u + f for u, f in zip(t.upload_s, t.first_token_s)]
    dtype = _SHORT_DTYPES.get(runner.dtype, str(runner.dtype))
    model = "embedded SmolLM2-135M" if args.model is None else f"{Path(args.model).stem} (random)"
    write_result(
        args.out or f"{'cpu' if on_cpu else 'gpu'}_adapter_upload.json",
        f"adapter upload to first token ({'CPU' if on_cpu else 'GPU'}, {model}, {dtype})",
        {
            "upload_to_first_token_s_median": statistics.median(totals),
            "upload_s_median": statistics.median(t.upload_s),
            "first_token_after_upload_s_median": statistics.median(t.first_token_s),
            "adapter_bytes": statistics.median(t.adapter_bytes),
        },
        {"base_model_first_token_s_median": t.base_first_token_s},
        engine_device=str(runner.device),
        model=args.model or "embedded",
        dtype=dtype,
        adapter_dtype=args.adapter_dtype,
        rank=args.rank,
        target_modules=list(MODULES),
        repeats=args.repeats,
        prompt=PROMPT if t.text_prompt else f"{PROMPT_IDS} random token ids",
        totals_s=totals,
        warmup_upload_to_first_token_s=t.warmup_total_s,
        engine_startup_s=startup_s,
        host_load_avg_1min=load_before,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
