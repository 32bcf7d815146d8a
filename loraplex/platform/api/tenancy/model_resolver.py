"""Model-name resolution: what an OpenAI `model` name means inside a tenant's namespace.

`ModelResolver` knows the base model and the server-wide adapters (`--lora-modules`);
`TenantModelResolver` adds each tenant's own adapters from the registry, by their names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.registry import AdapterRecord, AdapterRegistry
from loraplex.adapters.request import LoRARequest
from loraplex.platform.api.errors import model_not_found
from loraplex.platform.api.tenancy.tenant_store import OPEN_TENANT


@dataclass(frozen=True)
class ServedModel:
    """What an OpenAI `model` name resolves to: the base model, or one LoRA adapter on it."""

    name: str
    root: str  # the base model's served name
    adapter: str | None = None  # None = the base model itself
    lora_request: LoRARequest | None = None  # what the engine runs for the adapter
    created: int = 0  # unix time: the server's start (base), the adapter's registration


class ModelResolver:
    """Maps OpenAI `model` names, inside a tenant's namespace, to what serves them. This one
    knows only the base model; `TenantModelResolver` adds each tenant's adapters."""

    def __init__(self, base_name: str) -> None:
        self.base = ServedModel(name=base_name, root=base_name, created=int(time.time()))
        # `--lora-modules` adapters and those vLLM's `load_lora_adapter` adds at run time:
        # every tenant sees them, before its own of the same name
        self.server_wide: dict[str, ServedModel] = {}

    def add_server_wide(self, name: str, engine_name: str, path: str) -> None:
        """Serve the engine's adapter `engine_name` (folder `path`) as `name` to everyone."""
        self.server_wide[name] = ServedModel(
            name=name, root=self.base.name, adapter=name,
            lora_request=LoRARequest(engine_name, path), created=int(time.time()),
        )  # fmt: skip

    def remove_server_wide(self, name: str) -> ServedModel | None:
        """Stop serving the server-wide adapter `name`; the one removed, or None."""
        return self.server_wide.pop(name, None)

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


class TenantModelResolver(ModelResolver):
    """The base model under its served name, the server-wide adapters (`--lora-modules`), and
    the tenant's adapters from the registry.

    The same adapter name in two tenants resolves to two different engine adapters, named
    `tenant/name@digest` (see `AdapterRecord.engine_name`)."""

    def __init__(self, base_name: str, registry: AdapterRegistry) -> None:
        super().__init__(base_name)
        self.registry = registry

    def resolve_model(self, name: str | None, tenant: str = OPEN_TENANT) -> ServedModel:
        if name is None or name == self.base.name or name in self.server_wide:
            return super().resolve_model(name, tenant)
        record = self.registry.get(tenant, name)
        if record is None:
            raise model_not_found(name)
        if self.registry.shared and not Path(record.path).is_dir():
            # NOTE: uploaded through another replica a moment ago, before this one's registry
            # sync fetched it: fetch it now (blocking, once per adapter version and replica).
            try:
                self.registry.materialize(record)
            except (OSError, ValueError):
                raise model_not_found(name) from None
        return self.served(record)

    def list_models(self, tenant: str = OPEN_TENANT) -> list[ServedModel]:
        own = [self.served(r) for r in self.registry.list(tenant) if r.name not in self.server_wide]
        return [*super().list_models(tenant), *own]

    def served(self, record: AdapterRecord) -> ServedModel:
        return ServedModel(
            name=record.name,
            root=self.base.name,
            adapter=record.name,
            lora_request=LoRARequest(record.engine_name, record.path),
            created=int(record.created),
        )
