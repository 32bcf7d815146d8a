"""What every route reaches: the engine, the server settings, the model names, the metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from loraplex.adapters.registry import check_registry_url
from loraplex.adapters.request import LoRARequest
from loraplex.platform.api.errors import model_not_found
from loraplex.platform.api.lora_modules import LoRAModule
from loraplex.platform.api.metrics import ServerMetrics
from loraplex.platform.api.sampling import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    RequestLimits,
)
from loraplex.platform.api.tenancy import Tenancy
from loraplex.platform.api.tenants import OPEN_TENANT
from loraplex.platform.api.tool_parsers import TOOL_PARSERS
from loraplex.platform.engine.protocol import EngineClient
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer, Tokenizer

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_ADAPTER_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings (the engine has its own EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    disconnect_poll_s: float = 0.25
    data_dir: str | None = None  # the adapter registry and tenants (None: envs.data_dir())
    tenants_file: str | None = None  # a YAML file of static tenants
    admin_key: str | None = None  # None: LORAPLEX_ADMIN_KEY, if set
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES  # per adapter upload
    max_n: int = DEFAULT_MAX_N  # samples per prompt (`n`) of one request
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # prompts of one completion
    tool_call_parser: str | None = None  # vLLM's name; None: the one the chat template implies
    # where adapters and their catalogue live: "local" (data_dir), file:///shared/folder or
    # s3://bucket/prefix (one registry for every replica); see `open_registry`
    adapter_registry: str = "local"
    registry_sync_s: float = 2.0  # how often a shared registry's changes reach this engine
    # adapters served to every tenant from start-up (`--lora-modules`, as vLLM's)
    lora_modules: tuple[LoRAModule, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in [1, 65535], got {self.port}")
        if self.max_request_body_bytes < 1024:
            raise ValueError(
                f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}"
            )
        if self.disconnect_poll_s <= 0:
            raise ValueError(f"disconnect_poll_s must be positive, got {self.disconnect_poll_s}")
        if self.max_adapter_bytes < 1024:
            raise ValueError(f"max_adapter_bytes must be >= 1024, got {self.max_adapter_bytes}")
        for name in ("max_n", "max_prompts_per_request"):
            if not 1 <= getattr(self, name) <= 2**31 - 1:
                raise ValueError(f"{name} must be in [1, 2**31 - 1], got {getattr(self, name)}")
        check_registry_url(self.adapter_registry)
        if self.registry_sync_s <= 0:
            raise ValueError(f"registry_sync_s must be positive, got {self.registry_sync_s}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )


@dataclass(frozen=True)
class ServedModel:
    """What an OpenAI `model` name resolves to: the base model, or one LoRA adapter on it."""

    name: str
    root: str  # the base model's served name
    adapter: str | None = None  # None = the base model itself
    lora_request: LoRARequest | None = None  # what the engine runs for the adapter


class ModelResolver:
    """Maps OpenAI `model` names, inside a tenant's namespace, to what serves them. This one
    knows only the base model; `TenantModelResolver` adds each tenant's adapters."""

    def __init__(self, base_name: str) -> None:
        self.base = ServedModel(name=base_name, root=base_name)
        # `--lora-modules` adapters: every tenant sees them, before its own of the same name
        self.server_wide: dict[str, ServedModel] = {}

    def add_server_wide(self, name: str, engine_name: str, path: str) -> None:
        """Serve the engine's adapter `engine_name` (folder `path`) as `name` to everyone."""
        self.server_wide[name] = ServedModel(
            name=name, root=self.base.name, adapter=name,
            lora_request=LoRARequest(engine_name, path),
        )  # fmt: skip

    def resolve_model(self, name: str | None, tenant: str = OPEN_TENANT) -> ServedModel:
        """The served model of `name` (None = the base model); 404 `model_not_found` if none."""
        if name is None or name == self.base.name:
            return self.base
        served = self.server_wide.get(name)
        if served is None:
            raise model_not_found(name)
        return served

    def list_models(self, tenant: str = OPEN_TENANT) -> list[ServedModel]:
        return [self.base, *self.server_wide.values()]


@dataclass(frozen=True)
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    models: ModelResolver
    metrics: ServerMetrics
    tenancy: Tenancy

    async def tokenizer_of(self, served: ServedModel) -> Tokenizer | TokenIdsOnlyTokenizer:
        """The tokenizer requests on `served` are encoded and decoded with: its adapter's own
        when it stores one, else the base model's (read off the event loop)."""
        if served.lora_request is None:
            return self.engine.tokenizer
        return await asyncio.to_thread(self.engine.tokenizer_for, served.lora_request)

    @property
    def request_limits(self) -> RequestLimits:
        """What one request may ask of this server (`--max-n`, `--max-prompts-per-request`)."""
        return self.limits_for(self.engine.tokenizer)

    def limits_for(self, tokenizer: Tokenizer | TokenIdsOnlyTokenizer) -> RequestLimits:
        """`request_limits` for a request encoded with `tokenizer` (its token ids' range)."""
        return RequestLimits(
            vocab_size=tokenizer.vocab_size,
            max_n=self.settings.max_n,
            max_prompts_per_request=self.settings.max_prompts_per_request,
        )


def server_state(request: Request) -> ServerState:
    """The app's ServerState (set by `build_app`)."""
    return request.app.state.loraplex
