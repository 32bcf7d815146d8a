"""What every route reaches: the engine, the server settings, the model names, the metrics."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from loraplex.adapters.request import LoRARequest
from loraplex.platform.api.errors import model_not_found
from loraplex.platform.api.metrics import ServerMetrics
from loraplex.platform.api.openai.sampling import RequestLimits
from loraplex.platform.api.settings import ServerSettings
from loraplex.platform.api.tenancy import Tenancy
from loraplex.platform.api.tenants import OPEN_TENANT
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.models.tokenizer import TokenIdsOnlyTokenizer, Tokenizer


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
    engine: AsyncEngine
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
