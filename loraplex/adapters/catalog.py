"""`AdapterCatalog`: which content digest each tenant's adapter name points at.

A row is written only after its files are stored whole (`AdapterBlobStore.put`), in one atomic
write, so a reader on any replica sees the old row or the complete new adapter. Replacing a
name is last-writer-wins, as one SQLite `INSERT OR REPLACE` is.

`SQLiteCatalog` is a SQLite file: in this machine's data folder (WAL journal), or on a
filesystem every replica mounts (rollback journal: WAL needs memory shared between its users,
which processes on different hosts do not have). `S3Catalog` (in `s3_registry`) keeps one
object per row in an S3-compatible store.
"""

from __future__ import annotations

import sqlite3
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    digest TEXT NOT NULL,
    created REAL NOT NULL,
    size INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    modules TEXT NOT NULL,
    PRIMARY KEY (tenant, name)
)
"""


@dataclass(frozen=True)
class CatalogEntry:
    """One row: a tenant's adapter name and the stored content it names."""

    tenant: str
    name: str
    digest: str  # sha256 of adapter_config.json + adapter_model.safetensors
    created: float  # unix seconds
    size: int  # bytes of both files
    rank: int
    modules: tuple[str, ...]  # adapted projections, e.g. ("q_proj", "v_proj")


class AdapterCatalog(ABC):
    """The (tenant, name) -> digest table; every method is atomic on its own."""

    @abstractmethod
    def get(self, tenant: str, name: str) -> CatalogEntry | None: ...

    @abstractmethod
    def list(self, tenant: str | None = None) -> list[CatalogEntry]:
        """Every row of `tenant` (None: of all tenants), by (tenant, name)."""

    @abstractmethod
    def put(self, entry: CatalogEntry) -> None:
        """Insert or replace the row of (entry.tenant, entry.name)."""

    @abstractmethod
    def delete(self, tenant: str, name: str) -> None: ...

    def digests(self) -> set[str]:
        """Digests some row references."""
        return {entry.digest for entry in self.list()}

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections."""


class SQLiteCatalog(AdapterCatalog):
    """The catalogue in one SQLite file; thread-safe. `shared`: the file is on a filesystem
    other hosts write too (rollback journal, a long busy timeout)."""

    def __init__(self, path: Path, shared: bool = False) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            path, check_same_thread=False, isolation_level=None, timeout=30.0
        )
        self._db.execute("PRAGMA journal_mode=" + ("DELETE" if shared else "WAL"))
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def get(self, tenant: str, name: str) -> CatalogEntry | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM adapters WHERE tenant = ? AND name = ?", (tenant, name)
            ).fetchone()
        return None if row is None else _entry(row)

    def list(self, tenant: str | None = None) -> list[CatalogEntry]:
        query = "SELECT * FROM adapters"
        args: tuple[str, ...] = ()
        if tenant is not None:
            query, args = query + " WHERE tenant = ?", (tenant,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY tenant, name", args).fetchall()
        return [_entry(row) for row in rows]

    def put(self, entry: CatalogEntry) -> None:
        row = (entry.tenant, entry.name, entry.digest, entry.created, entry.size, entry.rank,
               ",".join(entry.modules))  # fmt: skip
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO adapters VALUES (?, ?, ?, ?, ?, ?, ?)", row)

    def delete(self, tenant: str, name: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM adapters WHERE tenant = ? AND name = ?", (tenant, name))

    def digests(self) -> set[str]:
        with self._lock:
            return {row[0] for row in self._db.execute("SELECT DISTINCT digest FROM adapters")}

    def close(self) -> None:
        self._db.close()


def _entry(row: tuple) -> CatalogEntry:
    tenant, name, digest, created, size, rank, modules = row
    modules_tuple = tuple(m for m in modules.split(",") if m)
    return CatalogEntry(tenant, name, digest, created, size, rank, modules_tuple)
