"""Tenants and their API keys.

Keys are random `sk-...` strings shown once; only their SHA-256 is stored. Tenants come from a
YAML file (static, keys given as SHA-256 hex) and from a SQLite table in the data folder
(created through the admin API). With no tenant and no admin key configured the server is
open: every caller is the one tenant `default`.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPEN_TENANT = "default"
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# NOTE: what SQLite and the scheduler can hold, with room to spare: a weight is a finite float
# (a share relative to other tenants'), a cap a 32-bit count.
MAX_WEIGHT = 1e6
MAX_CAP = 2**31 - 1
_NAME = re.compile(TENANT_NAME_PATTERN)
TENANTS_DB = "tenants.sqlite"  # in the data folder
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    weight REAL NOT NULL,
    max_concurrent_requests INTEGER,
    tokens_per_minute INTEGER,
    created REAL NOT NULL
)
"""


def hash_key(key: str) -> str:
    """The stored form of an API key: its SHA-256, hex."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def check_tenant_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"tenant name must be 1-64 letters, digits, '_', '.' or '-' (not first), got {name!r}"
        )
    return name


@dataclass(frozen=True)
class Tenant:
    """A tenant and its share of the server: a fair-queuing weight and optional caps."""

    name: str
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    static: bool = False  # declared in the YAML file: not editable through the API

    def __post_init__(self) -> None:
        check_tenant_name(self.name)
        weight = self.weight
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or not 0 < weight <= MAX_WEIGHT
        ):
            raise ValueError(
                f"tenant {self.name}: weight must be a finite number in (0, {MAX_WEIGHT:g}], "
                f"got {weight!r}"
            )
        for field in ("max_concurrent_requests", "tokens_per_minute"):
            value = getattr(self, field)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CAP
            ):
                raise ValueError(
                    f"tenant {self.name}: {field} must be an integer in [1, {MAX_CAP}], "
                    f"got {value!r}"
                )

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weight": self.weight,
            "max_concurrent_requests": self.max_concurrent_requests,
            "tokens_per_minute": self.tokens_per_minute,
            "static": self.static,
        }


def load_static_tenants(path: str | Path) -> dict[str, tuple[Tenant, str]]:
    """Tenants of a YAML file: `tenants: [{name, key_sha256, weight?, max_concurrent_requests?,
    tokens_per_minute?}]` -> name -> (tenant, key hash)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    entries = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with a `tenants` list")
    tenants: dict[str, tuple[Tenant, str]] = {}
    for entry in entries:
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: each tenant must be a mapping, got {entry!r}")
        entry = dict(entry)
        key_hash = str(entry.pop("key_sha256", "")).lower()
        if not _HEX64.match(key_hash):
            raise ValueError(f"{path}: tenant {entry.get('name')!r} needs key_sha256 (64 hex)")
        try:
            tenant = Tenant(**entry, static=True)
        except TypeError as error:
            raise ValueError(f"{path}: {error}") from None
        if tenant.name in tenants:
            raise ValueError(f"{path}: tenant {tenant.name!r} is declared twice")
        tenants[tenant.name] = (tenant, key_hash)
    return tenants


class TenantStore:
    """Static and stored tenants; look-up by API key. Thread-safe."""

    def __init__(
        self,
        data_dir: str | Path,
        static_file: str | Path | None = None,
        admin_key: str | None = None,
    ) -> None:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        self._static = load_static_tenants(static_file) if static_file else {}
        self._admin_hash = hash_key(admin_key) if admin_key else None
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            Path(data_dir) / TENANTS_DB, check_same_thread=False, isolation_level=None
        )
        self._db.execute(_SCHEMA)

    @property
    def has_admin(self) -> bool:
        return self._admin_hash is not None

    @property
    def is_open(self) -> bool:
        """No admin key and no tenant: every caller is the tenant `default`."""
        return not self.has_admin and not self._static and not self._count()

    @property
    def num_stored(self) -> int:
        """Tenants in the data folder's table (created through the admin API)."""
        return self._count()

    def is_admin_key(self, key: str) -> bool:
        return self._admin_hash is not None and secrets.compare_digest(
            hash_key(key), self._admin_hash
        )

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant whose key this is, or None."""
        digest = hash_key(key)
        for tenant, key_hash in self._static.values():
            if secrets.compare_digest(digest, key_hash):
                return tenant
        with self._lock:
            row = self._db.execute("SELECT * FROM tenants WHERE key_hash = ?", (digest,)).fetchone()
        return None if row is None else _tenant(row)

    def get(self, name: str) -> Tenant | None:
        if name in self._static:
            return self._static[name][0]
        with self._lock:
            row = self._db.execute("SELECT * FROM tenants WHERE name = ?", (name,)).fetchone()
        return None if row is None else _tenant(row)

    def list(self) -> list[Tenant]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM tenants ORDER BY name").fetchall()
        stored = [_tenant(row) for row in rows]
        return sorted([t for t, _ in self._static.values()] + stored, key=lambda t: t.name)

    def create(self, tenant: Tenant) -> str:
        """Store a new tenant; returns its API key (shown once). ValueError if the name exists."""
        if self.get(tenant.name) is not None:
            raise ValueError(f"tenant {tenant.name!r} already exists")
        key = new_key()
        with self._lock, self._db:
            self._db.execute(
                "INSERT INTO tenants VALUES (?, ?, ?, ?, ?, ?)",
                (
                    tenant.name,
                    hash_key(key),
                    tenant.weight,
                    tenant.max_concurrent_requests,
                    tenant.tokens_per_minute,
                    time.time(),
                ),
            )
        return key

    def rotate_key(self, name: str) -> str | None:
        """A new key for a stored tenant (the old one stops working); None if no such tenant."""
        self._check_editable(name)
        key = new_key()
        with self._lock, self._db:
            cursor = self._db.execute(
                "UPDATE tenants SET key_hash = ? WHERE name = ?", (hash_key(key), name)
            )
        return key if cursor.rowcount else None

    def delete(self, name: str) -> bool:
        self._check_editable(name)
        with self._lock, self._db:
            cursor = self._db.execute("DELETE FROM tenants WHERE name = ?", (name,))
        return bool(cursor.rowcount)

    def close(self) -> None:
        self._db.close()

    def _check_editable(self, name: str) -> None:
        if name in self._static:
            raise ValueError(f"tenant {name!r} is declared in the tenants file; edit it there")

    def _count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM tenants").fetchone()[0]


def _tenant(row: tuple) -> Tenant:
    name, _, weight, max_concurrent, tpm, _ = row
    return Tenant(name, weight, max_concurrent, tpm)
