"""`TenantModelResolver`: a tenant sees the base model and its own adapters, by their names."""

from __future__ import annotations

from pathlib import Path

from loraplex.adapters.registry import AdapterRecord, AdapterRegistry
from loraplex.adapters.request import LoRARequest
from loraplex.platform.api.errors import model_not_found
from loraplex.platform.api.state import ModelResolver, ServedModel
from loraplex.platform.api.tenants import OPEN_TENANT


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
        )
