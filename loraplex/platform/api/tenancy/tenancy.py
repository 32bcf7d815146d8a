"""`Tenancy`: what the server knows about tenants — keys, adapters, limits, per-tenant metrics —
and `Caller`, who sent a request."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.registry import open_registry
from loraplex.platform.api.metrics.tenant_metrics import TenantMetrics
from loraplex.platform.api.tenancy.tenant_store import OPEN_TENANT, TENANTS_DB, Tenant, TenantStore

BEARER = "bearer "


@dataclass(frozen=True)
class Caller:
    """Who sent a request: a tenant, or the admin. On an open server every caller is the one
    tenant, and the admin too; but with no admin key the admin routes are off (403)."""

    tenant: Tenant | None
    is_admin: bool


class Tenancy:
    """Tenants, their adapter registry, their limits and metrics, under one data folder."""

    def __init__(
        self,
        data_dir: str | Path,
        tenants_file: str | Path | None = None,
        admin_key: str | None = None,
        adapter_registry: str = "local",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.registry = open_registry(adapter_registry, self.data_dir)
        # NOTE: the tenant table lives beside the catalogue: in the data folder, or in the
        # folder every replica mounts (file://); an s3:// registry keeps it in the data folder
        # (share tenants between replicas then through --tenants, a file every replica reads).
        self.tenants = TenantStore(self.registry.root, tenants_file, admin_key)
        self.metrics = TenantMetrics()

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

    def startup_warnings(self, host: str) -> list[str]:
        """What an operator must hear at start: tenants in the data folder with no admin key to
        manage them (every caller now needs a tenant's key), or an open server on a
        non-loopback address."""
        warnings = []
        stored = self.tenants.num_stored
        if stored and not self.tenants.has_admin:
            db = self.data_dir / TENANTS_DB
            warnings.append(
                f"The data folder {self.data_dir} holds {stored} tenant(s) and this server has no "
                "admin key: every request needs a tenant's API key (others get 401) and the admin "
                "API is off (403). Start with --admin-key (or LORAPLEX_ADMIN_KEY) to manage "
                f"tenants; to serve openly again, start with another --data-dir or move {db} "
                "away."
            )
        if self.tenants.is_open and host not in ("127.0.0.1", "localhost", "::1"):
            warnings.append(
                f"This server is open (no admin key, no tenants) and listens on {host}: anyone "
                "who reaches it can generate and manage adapters. Start with --admin-key (or "
                "LORAPLEX_ADMIN_KEY) and create tenants to require API keys."
            )
        return warnings

    def all_tenants(self) -> list[Tenant]:
        """Every configured tenant (the open server's one tenant when none is)."""
        return self.tenants.list() or [Tenant(OPEN_TENANT)]

    def close(self) -> None:
        self.tenants.close()
        self.registry.close()
