"""`AdapterRegistry`: the persistent catalogue of every tenant's adapters.

A SQLite catalogue maps `(tenant, name)` to a content digest; the files live once per digest
under `<data_dir>/adapters/<sha256>/`. Writes are crash-safe: files are staged in a temporary
folder under `<data_dir>/tmp/`, renamed into place, and only then is the catalogue row written,
in one transaction. A crash therefore leaves the old row (and, at worst, an unreferenced blob or
a temporary folder, which `AdapterRegistry` deletes when it opens), never half an adapter.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, LoRAWeights, content_digest

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
class AdapterRecord:
    """One catalogued adapter of one tenant."""

    tenant: str
    name: str
    digest: str  # sha256 of adapter_config.json + adapter_model.safetensors
    created: float  # unix seconds
    size: int  # bytes of both files
    rank: int
    modules: tuple[str, ...]  # adapted projections, e.g. ("q_proj", "v_proj")
    path: str  # the content-addressed folder

    @property
    def engine_name(self) -> str:
        """The adapter's engine-wide name: distinct per tenant and per version."""
        return f"{self.tenant}/{self.name}@{self.digest[:12]}"


def _stored_digest(blob: Path) -> str | None:
    """The content digest of a stored adapter's files, None if they cannot be read."""
    try:
        return content_digest((blob / CONFIG_FILE).read_bytes(), (blob / WEIGHTS_FILE).read_bytes())
    except OSError:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AdapterRegistry:
    """The catalogue and the content-addressed files under `data_dir`; thread-safe."""

    def __init__(self, data_dir: str | Path) -> None:
        self.root = Path(data_dir)
        self.blobs = self.root / "adapters"
        self.tmp = self.root / "tmp"
        for folder in (self.root, self.blobs, self.tmp):
            folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.root / "adapters.sqlite", check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        self.recover()

    # -- staging --------------------------------------------------------------------------------

    def new_staging_dir(self) -> Path:
        """A fresh temporary folder to write an upload into (deleted on recovery if left)."""
        path = self.tmp / f"upload-{uuid.uuid4().hex}"
        path.mkdir()
        return path

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    # -- writes ---------------------------------------------------------------------------------

    def commit(
        self, tenant: str, name: str, staging: Path, weights: LoRAWeights
    ) -> tuple[AdapterRecord, AdapterRecord | None]:
        """Move a validated staging folder into place and catalogue it under (tenant, name).

        Returns (new record, the record it replaced or None). The staging folder is consumed."""
        blob = self.blobs / weights.digest
        size = sum((staging / f).stat().st_size for f in (CONFIG_FILE, WEIGHTS_FILE))
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            with open(staging / f, "rb") as handle:
                os.fsync(handle.fileno())
        with self._lock:
            if blob.is_dir() and _stored_digest(blob) == weights.digest:
                self.discard(staging)
            else:
                for extra in staging.iterdir():
                    if extra.name not in (CONFIG_FILE, WEIGHTS_FILE):
                        shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
                damaged = None
                if blob.is_dir():
                    # NOTE: files that no longer hash to their name (damaged on disk): the
                    # upload of the same content replaces them.
                    damaged = self.tmp / f"damaged-{uuid.uuid4().hex}"
                    os.rename(blob, damaged)
                os.rename(staging, blob)
                _fsync_dir(self.blobs)
                if damaged is not None:
                    shutil.rmtree(damaged, ignore_errors=True)
            old = self._get(tenant, name)
            modules = ",".join(sorted({module for _, module in weights.modules}))
            with self._db:
                self._db.execute(
                    "INSERT OR REPLACE INTO adapters VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (tenant, name, weights.digest, time.time(), size, weights.rank, modules),
                )
            return self._get(tenant, name), old  # type: ignore[return-value]

    def delete(self, tenant: str, name: str) -> AdapterRecord | None:
        """Remove (tenant, name) from the catalogue; returns the removed record, if any.

        NOTE: the files stay until no row references them and the registry reopens or
        `collect_garbage` runs, so requests still running on them can reload them."""
        with self._lock:
            old = self._get(tenant, name)
            if old is not None:
                with self._db:
                    self._db.execute(
                        "DELETE FROM adapters WHERE tenant = ? AND name = ?", (tenant, name)
                    )
            return old

    # -- reads ----------------------------------------------------------------------------------

    def get(self, tenant: str, name: str) -> AdapterRecord | None:
        with self._lock:
            return self._get(tenant, name)

    def list(self, tenant: str | None = None) -> list[AdapterRecord]:
        """Every record of `tenant` (None: of all tenants), by name."""
        query = "SELECT * FROM adapters"
        args: tuple[str, ...] = ()
        if tenant is not None:
            query, args = query + " WHERE tenant = ?", (tenant,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY tenant, name", args).fetchall()
        return [self._record(row) for row in rows]

    def disk_count(self) -> int:
        """Adapter versions stored on disk."""
        return sum(1 for p in self.blobs.iterdir() if p.is_dir())

    # -- recovery -------------------------------------------------------------------------------

    def recover(self) -> None:
        """Delete temporary folders and unreferenced blobs left by a crash."""
        for leftover in self.tmp.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
        self.collect_garbage()

    def collect_garbage(self, keep: frozenset[str] = frozenset()) -> None:
        """Delete blobs no catalogue row references, except the digests in `keep`."""
        with self._lock:
            used = {row[0] for row in self._db.execute("SELECT DISTINCT digest FROM adapters")}
            for blob in self.blobs.iterdir():
                if blob.name not in used and blob.name not in keep:
                    shutil.rmtree(blob, ignore_errors=True)

    def close(self) -> None:
        self._db.close()

    # -- internals ------------------------------------------------------------------------------

    def _get(self, tenant: str, name: str) -> AdapterRecord | None:
        row = self._db.execute(
            "SELECT * FROM adapters WHERE tenant = ? AND name = ?", (tenant, name)
        ).fetchone()
        return None if row is None else self._record(row)

    def _record(self, row: tuple) -> AdapterRecord:
        tenant, name, digest, created, size, rank, modules = row
        return AdapterRecord(
            tenant,
            name,
            digest,
            created,
            size,
            rank,
            tuple(m for m in modules.split(",") if m),
            str(self.blobs / digest),
        )
