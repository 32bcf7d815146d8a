"""`Tenancy`: what the server knows about tenants — keys, adapters, limits, per-tenant metrics —
and `Caller`, who sent a request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.registry import AdapterRegistry
from loraplex.platform.api.limits import TenantLimiter
from loraplex.platform.api.tenant_metrics import TenantMetrics
from loraplex.platform.api.tenants import OPEN_TENANT, Tenant, TenantStore

BEARER = "bearer "


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a tenant, the admin, or (open server) both."""

    tenant: Tenant | None
    is_admin: bool


class Tenancy:
    """Tenants, their adapter registry, their limits and metrics, under one data folder."""

    def __init__(
        self,
        data_dir: str | Path,
        tenants_file: str | Path | None = None,
        admin_key: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.tenants = TenantStore(self.data_dir, tenants_file, admin_key)
        self.registry = AdapterRegistry(self.data_dir)
        self.limiter = TenantLimiter()
        self.metrics = TenantMetrics(self.limiter)

    def identify(self, authorization: str | None) -> Caller | None:
        """The caller of an `Authorization: Bearer <key>` header; None for a missing or unknown
        key on a closed server."""
        if self.tenants.is_open:
            return Caller(Tenant(OPEN_TENANT), is_admin=True)
        if not authorization or not authorization.lower().startswith(BEARER):
            return None
        key = authorization[len(BEARER) :].strip()
        if not key:
            return None
        if self.tenants.is_admin_key(key):
            return Caller(None, is_admin=True)
        tenant = self.tenants.authenticate(key)
        return None if tenant is None else Caller(tenant, is_admin=False)

    def all_tenants(self) -> list[Tenant]:
        """Every configured tenant (the open server's one tenant when none is)."""
        return self.tenants.list() or [Tenant(OPEN_TENANT)]

    def close(self) -> None:
        self.tenants.close()
        self.registry.close()
