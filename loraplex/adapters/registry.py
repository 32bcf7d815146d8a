"""`AdapterRegistry`: the persistent catalogue of every tenant's adapters, for one replica or
for many.

An `AdapterCatalog` maps `(tenant, name)` to a content digest; an `AdapterBlobStore` keeps the
files once per digest. Writes are crash-safe: files are staged in a temporary folder, stored
under their digest atomically, and only then is the catalogue row written, in one atomic write.
A crash (kill -9) therefore leaves the old row (and, at worst, an unreferenced folder or a
staging leftover, which recovery deletes), never half an adapter, on this replica or any other.

`open_registry` picks the pair from a URL: this machine's data folder (the default), a folder on
a filesystem all replicas mount (`file:///mnt/shared/loraplex`), or an S3-compatible bucket
(`s3://bucket/prefix`). With a shared registry, an adapter uploaded through any replica is
served by every replica.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from loraplex.adapters.blob_store import AdapterBlobStore, LocalBlobStore, present_files
from loraplex.adapters.catalog import AdapterCatalog, CatalogEntry, SQLiteCatalog
from loraplex.adapters.peft_format import LoRAWeights


@dataclass(frozen=True)
class AdapterRecord(CatalogEntry):
    """One catalogued adapter of one tenant: its catalog row, and where its files are here."""

    path: str  # the content-addressed folder on this machine (see `AdapterRegistry.materialize`)

    @property
    def engine_name(self) -> str:
        """The adapter's engine-wide name: distinct per tenant and per version."""
        return f"{self.tenant}/{self.name}@{self.digest[:12]}"


class AdapterRegistry:
    """A catalogue and a content-addressed store; thread-safe.

    `AdapterRegistry(data_dir)` is the single-replica registry under `data_dir`
    (`adapters.sqlite`, `adapters/<sha256>/`, `tmp/`); `shared=True` keeps the same layout on a
    filesystem other replicas write too. Other stores come through `store` and `catalog`."""

    def __init__(
        self,
        data_dir: str | Path,
        shared: bool = False,
        store: AdapterBlobStore | None = None,
        catalog: AdapterCatalog | None = None,
    ) -> None:
        self.root = Path(data_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = store or LocalBlobStore(self.root / "adapters", self.root / "tmp", shared)
        self.catalog = catalog or SQLiteCatalog(self.root / "adapters.sqlite", shared)
        self._lock = threading.Lock()
        self.recover()

    @property
    def shared(self) -> bool:
        """Whether other replicas read and write this registry too."""
        return self.store.shared

    @property
    def tmp(self) -> Path:
        """Where uploads are staged."""
        return self.store.tmp

    @property
    def blobs(self) -> Path:
        """The folder of stored adapters on this machine (a download cache for remote stores)."""
        return self.store.root

    # -- staging --------------------------------------------------------------------------------

    def new_staging_dir(self) -> Path:
        """A fresh temporary folder to write an upload into (deleted on recovery if left)."""
        return self.store.new_staging_dir()

    def discard(self, staging: Path) -> None:
        self.store.discard(staging)

    # -- writes ---------------------------------------------------------------------------------

    def commit(
        self, tenant: str, name: str, staging: Path, weights: LoRAWeights
    ) -> tuple[AdapterRecord, AdapterRecord | None]:
        """Store a validated staging folder and catalogue it under (tenant, name).

        Returns (new record, the record it replaced or None). The staging folder is consumed."""
        size = sum((staging / f).stat().st_size for f in present_files(staging))
        with self._lock:
            self.store.put(weights.digest, staging)
            old = self.catalog.get(tenant, name)
            modules = tuple(sorted({module for _, module in weights.modules}))
            entry = CatalogEntry(tenant, name, weights.digest, time.time(), size, weights.rank,
                                 modules)  # fmt: skip
            self.catalog.put(entry)
            return self._record(entry), None if old is None else self._record(old)

    def delete(self, tenant: str, name: str) -> AdapterRecord | None:
        """Remove (tenant, name) from the catalogue; returns the removed record, if any.

        NOTE: the files stay until no row references them and the registry reopens or
        `collect_garbage` runs, so requests still running on them can reload them."""
        with self._lock:
            old = self.catalog.get(tenant, name)
            if old is not None:
                self.catalog.delete(tenant, name)
            return None if old is None else self._record(old)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, tenant: str, name: str) -> AdapterRecord | None:
        entry = self.catalog.get(tenant, name)
        return None if entry is None else self._record(entry)

    def list(self, tenant: str | None = None) -> list[AdapterRecord]:
        """Every record of `tenant` (None: of all tenants), by name."""
        return [self._record(entry) for entry in self.catalog.list(tenant)]

    def disk_count(self) -> int:
        """Adapter versions stored."""
        return len(self.store.digests())

    def materialize(self, record: AdapterRecord) -> Path:
        """The record's folder on this machine, downloaded first from a remote store;
        FileNotFoundError if the store has no complete copy."""
        return self.store.materialize(record.digest)

    # -- recovery -------------------------------------------------------------------------------

    def recover(self) -> None:
        """Delete staging leftovers and unreferenced files left by a crash."""
        self.store.recover()
        self.collect_garbage()

    def collect_garbage(self, keep: frozenset[str] = frozenset()) -> None:
        """Delete stored files no catalogue row references, except the digests in `keep` (in a
        shared registry, only those older than the store's grace period)."""
        with self._lock:
            self.store.collect_garbage(self.catalog.digests() | set(keep))

    def close(self) -> None:
        self.catalog.close()

    # -- internals ------------------------------------------------------------------------------

    def _record(self, entry: CatalogEntry) -> AdapterRecord:
        return AdapterRecord(**asdict(entry), path=str(self.store.local_path(entry.digest)))


def check_registry_url(url: str) -> str:
    """The URL's kind ("local", "file" or "s3"); ValueError for a URL `open_registry` refuses."""
    if url in ("", "local"):
        return "local"
    parsed = urlparse(url)
    if parsed.scheme == "file" and parsed.path.startswith("/") and not parsed.netloc:
        return "file"
    if parsed.scheme == "s3" and parsed.netloc:
        return "s3"
    raise ValueError(
        f"adapter registry {url!r}: use 'local', file:///shared/folder or s3://bucket/prefix"
    )


def open_registry(url: str, data_dir: str | Path) -> AdapterRegistry:
    """The registry a URL names: "" or "local" (this machine's `data_dir`),
    `file:///path` (a folder every replica mounts) or `s3://bucket/prefix` (an S3-compatible
    store through boto3, with its usual settings: AWS_ENDPOINT_URL, credentials, region;
    downloads are cached under `data_dir`). ValueError for anything else."""
    kind = check_registry_url(url)
    if kind == "local":
        return AdapterRegistry(data_dir)
    parsed = urlparse(url)
    if kind == "file":
        return AdapterRegistry(parsed.path, shared=True)
    from loraplex.adapters.s3_registry import open_s3_registry

    return open_s3_registry(parsed.netloc, parsed.path.lstrip("/"), Path(data_dir))
