"""loraplex behind Ray Serve (`pip install loraplex[ray]`): one engine per replica, requests routed
by adapter through Ray Serve's model multiplexing.

Two deployments form the application:

- `OpenAIIngress` (the HTTP entry, one replica by default) reads each request's `model` and sends
  the request on to a `LoraplexReplica` through a deployment handle with
  `multiplexed_model_id` set to the adapter (qualified by a hash of the caller's key, since
  adapter names are per tenant; the base model and the non-generation routes carry none). Ray
  Serve then prefers a replica that already holds that adapter, else the one holding the fewest.
- `LoraplexReplica` (N replicas) runs the whole loraplex server in-process: the FastAPI app of
  `build_app` over its own `InprocClient` (OpenAI, adapter, admin routes, /metrics), served to
  the ingress through ASGI calls. `@serve.multiplexed` records which adapters the replica holds
  (`serve.get_multiplexed_model_id`), up to `max_loras`; the engine's slot pool does the
  actual loading and eviction.

Replicas share one adapter registry (`adapter_registry`: file:// or s3://, see
`open_registry`), so an adapter uploaded through any replica is served by all of them.

Entry points: `loraplex serve-ray --replicas N ...` (the `serve` options), or
`build_ray_app(engine_config, settings, replicas)` and `ray.serve.run` from Python.
"""

# NOTE: no `from __future__ import annotations` here: FastAPI reads the ingress route's
# annotations at decoration time, and `Request` is imported inside `build_ray_app` (this module
# is imported by the CLI's parser, which must not load web or engine packages).
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.config import EngineConfig
    from loraplex.platform.api.settings import ServerSettings

REPLICA_HEADER = "x-loraplex-replica"  # which replica answered (for tracing and tests)
MULTIPLEX_HEADER = "serve_multiplexed_model_id"  # Ray Serve's own routing header


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress hands it to a replica (plain values: it is pickled)."""

    method: str
    path: str  # with the query string
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


def multiplexed_model_id(body: bytes, authorization: str | None) -> str:
    """The routing key of a request: its `model` (qualified by a hash of the caller's key, as
    adapter names are per tenant), or "" when the body names no model."""
    try:
        model = json.loads(body).get("model") if body else None
    except (ValueError, AttributeError):
        return ""
    if not isinstance(model, str) or not model:
        return ""
    if authorization:
        return f"{model}#{hashlib.sha256(authorization.encode()).hexdigest()[:12]}"
    return model


async def _call_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[tuple[str, Any]]:
    """Run one request through an ASGI app; yields ("start", (status, headers)) then
    ("body", bytes) chunks as the app sends them."""
    import asyncio

    path, _, query = request.path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": query.encode(), "headers": list(request.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "root_path": "",
    }  # fmt: skip
    queue: asyncio.Queue = asyncio.Queue()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the ingress owns the client connection
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await queue.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.create_task(queue.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                task.result()  # raises what the app raised
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                yield "start", (message["status"], message.get("headers", []))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield "body", message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        if not task.done():
            task.cancel()


def build_ray_app(
    engine_config: "EngineConfig",
    settings: "ServerSettings",
    replicas: int,
    ingress_replicas: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
):
    """The Ray Serve application (pass it to `ray.serve.run`); ValueError for bad counts."""
    if replicas < 1 or ingress_replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas} and {ingress_replicas}")
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from ray import serve

    max_models = engine_config.lora.max_loras if engine_config.lora.enable_lora else 1

    @serve.deployment(
        num_replicas=replicas, max_ongoing_requests=engine_config.scheduler.max_num_seqs * 4,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
    )  # fmt: skip
    class LoraplexReplica:
        """One loraplex server (engine + app) per replica."""

        async def __init__(self) -> None:
            from loraplex.platform.api.app import build_app
            from loraplex.platform.engine.inproc_client import InprocClient

            self.name = serve.get_replica_context().replica_tag
            self.app = build_app(InprocClient(engine_config), settings)
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()  # starts the engine, registers stored adapters

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, model_id: str) -> str:
            # NOTE: nothing to load here: the engine loads adapter weights into its GPU slots
            # ahead of the first request. This records that the replica holds the adapter, so
            # Ray Serve routes its next requests here.
            return model_id

        async def handle(self, request: ForwardedRequest) -> AsyncIterator[Any]:
            """Stream the app's answer: (status, headers) first, then body chunks."""
            model_id = serve.get_multiplexed_model_id()
            if model_id:
                await self.get_model(model_id)
            async for kind, item in _call_asgi(self.app, request):
                if kind == "start":
                    status, headers = item
                    yield status, [*headers, (REPLICA_HEADER.encode(), self.name.encode())]
                else:
                    yield item

        async def __del__(self) -> None:
            await self._lifespan.__aexit__(None, None, None)

    ingress_app = FastAPI(title="loraplex (Ray Serve)", openapi_url=None)

    @serve.deployment(num_replicas=ingress_replicas, ray_actor_options={"num_cpus": 0})
    @serve.ingress(ingress_app)
    class OpenAIIngress:
        """The HTTP entry: forwards every request to a replica chosen by its adapter."""

        def __init__(self, replica) -> None:
            self.replica = replica

        @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def forward(self, path: str, request: Request) -> Response:
            body = await request.body()
            query = f"?{request.url.query}" if request.url.query else ""
            forwarded = ForwardedRequest(
                request.method, f"/{path}{query}", tuple(request.headers.raw), body
            )
            model_id = request.headers.get(MULTIPLEX_HEADER) or multiplexed_model_id(
                body, request.headers.get("authorization")
            )
            handle = self.replica.options(stream=True, multiplexed_model_id=model_id)
            chunks = handle.handle.remote(forwarded)
            status, headers = await chunks.__anext__()
            kept = {k.decode(): v.decode() for k, v in headers if k.lower() != b"content-length"}
            media_type = kept.pop("content-type", None)
            return StreamingResponse(chunks, status_code=status, headers=kept,
                                     media_type=media_type)  # fmt: skip

    return OpenAIIngress.bind(LoraplexReplica.bind())


def add_serve_ray_parser(subparsers) -> None:
    """Add `serve-ray` to the `loraplex` command: the `serve` options plus the replica counts."""
    from loraplex.entrypoints.serve_cli import add_serve_parser

    parser = add_serve_parser(subparsers, name="serve-ray")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    parser.add_argument("--ingress-replicas", type=int, default=1,
                        help="HTTP ingress replicas (default 1)")  # fmt: skip
    parser.add_argument("--num-gpus-per-replica", type=float, default=None,
                        help="GPUs per engine replica (default: 1 on CUDA, else 0)")  # fmt: skip
    parser.add_argument("--ray-address", default=None,
                        help="a running Ray cluster (default: start a local one)")  # fmt: skip


def run_serve_ray(args) -> int:
    """Start (or join) Ray, run the application on --host/--port, serve until Ctrl-C."""
    import time

    from loraplex.entrypoints.serve_cli import engine_config, resolve_options, server_settings

    try:
        import ray
        from ray import serve
    except ImportError:
        print("loraplex serve-ray: error: Ray Serve is not installed: pip install 'loraplex[ray]'")
        return 2
    values = resolve_options(args)
    config = engine_config(values)
    settings = server_settings(values)
    if settings.runtime_lora_updating and args.replicas > 1:
        # NOTE: as with several API processes (launcher): each replica keeps its own table
        raise ValueError(
            "runtime LoRA updating (--allow-runtime-lora-updating, "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs --replicas 1: each replica keeps its own "
            "list of server-wide adapters"
        )
    if settings.adapter_registry == "local" and args.replicas > 1:
        print("loraplex serve-ray: warning: --adapter-registry local: each replica keeps its own "
              "adapters; give a file:// or s3:// registry to share them")  # fmt: skip
    gpus = args.num_gpus_per_replica
    if gpus is None:
        import torch

        on_cuda = config.model.device.startswith("cuda") or (
            config.model.device == "auto" and torch.cuda.is_available()
        )
        gpus = 1.0 if on_cuda else 0.0
    ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    app = build_ray_app(config, settings, args.replicas, args.ingress_replicas, num_gpus=gpus)
    serve.run(app, name="loraplex", route_prefix="/")
    print(f"loraplex serve-ray: {args.replicas} replica(s) on http://{settings.host}:"
          f"{settings.port}", flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
