"""The adapter registry in an S3-compatible object store (AWS S3, MinIO, Ceph RGW, R2...),
through boto3 (`pip install loraplex[s3]`).

Layout under `s3://<bucket>/<prefix>`:

- `blobs/<digest>/adapter_config.json`, `blobs/<digest>/adapter_model.safetensors`, and
  `blobs/<digest>/COMPLETE`, written last: one object PUT is atomic, so a folder without its
  marker is an upload cut short (killed writer) and is invisible to every reader;
- `catalog/<tenant>/<name>.json`: one catalogue row per object, written after the marker.

A replica downloads a digest once into its local cache (`<data_dir>/adapters/<digest>/`, by
staging and rename), checks it against the digest, and serves it from there.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from loraplex.adapters.blob_store import (
    ADAPTER_FILES,
    SHARED_GRACE_S,
    STORED_FILES,
    AdapterBlobStore,
    fsync_files,
    present_files,
    stored_digest,
)
from loraplex.adapters.catalog import AdapterCatalog, CatalogEntry

COMPLETE = "COMPLETE"


def _missing(error: Exception) -> bool:
    """Whether a botocore ClientError says the key does not exist."""
    code = getattr(error, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


class S3BlobStore(AdapterBlobStore):
    """Adapter folders as objects, downloaded on demand into `cache_dir`."""

    def __init__(self, client: Any, bucket: str, prefix: str, cache_dir: Path) -> None:
        super().__init__(cache_dir / "adapters", cache_dir / "tmp", SHARED_GRACE_S)
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def _key(self, digest: str, name: str) -> str:
        return f"{self.prefix}blobs/{digest}/{name}"

    def _complete(self, digest: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(digest, COMPLETE))
        except Exception as error:
            if _missing(error):
                return False
            raise
        return True

    def put(self, digest: str, staging: Path) -> None:
        if self._complete(digest) and self._verify_cached(digest):
            self.discard(staging)
            return
        for name in present_files(staging):
            self.client.upload_file(str(staging / name), self.bucket, self._key(digest, name))
        self.client.put_object(Bucket=self.bucket, Key=self._key(digest, COMPLETE), Body=b"")
        self._install(digest, staging)  # the uploader's cache holds it already

    def _verify_cached(self, digest: str) -> bool:
        """Whether the stored copy is whole and valid (downloading it if not cached)."""
        try:
            return stored_digest(self.materialize(digest)) == digest
        except (FileNotFoundError, ValueError):
            return False

    def materialize(self, digest: str) -> Path:
        local = self.local_path(digest)
        if local.is_dir() and stored_digest(local) == digest:
            return local
        if not self._complete(digest):
            raise FileNotFoundError(f"no stored adapter {digest}")
        staging = self.new_staging_dir()
        try:
            for name in STORED_FILES:
                try:
                    self.client.download_file(
                        self.bucket, self._key(digest, name), str(staging / name)
                    )
                except Exception as error:
                    if name in ADAPTER_FILES or not _missing(error):
                        raise  # a tokenizer file is there only for adapters that have one
            if stored_digest(staging) != digest:
                raise ValueError(f"the stored files of adapter {digest} do not match its digest")
            self._install(digest, staging)
        finally:
            self.discard(staging)
        return local

    def _install(self, digest: str, staging: Path) -> None:
        """Rename a verified staging folder into the local cache (another thread may win)."""
        local = self.local_path(digest)
        if local.is_dir() and stored_digest(local) == digest:
            self.discard(staging)
            return
        fsync_files(staging)
        if local.is_dir():
            self.discard(local)  # damaged cache copy
        try:
            os.rename(staging, local)
        except OSError:
            self.discard(staging)

    def local_path(self, digest: str) -> Path:
        return self.root / digest

    def digests(self) -> set[str]:
        return {key.split("/")[-2] for key, _ in self._objects("blobs/") if key.endswith(COMPLETE)}

    def collect_garbage(self, used: set[str]) -> None:
        cutoff = time.time() - self.grace_s
        for key, modified in self._objects("blobs/"):
            digest = key[len(self.prefix) :].split("/")[1]
            if digest not in used and modified < cutoff:
                self.client.delete_object(Bucket=self.bucket, Key=key)
        for local in self.root.iterdir():
            if local.name not in used:
                self.discard(local)

    def _objects(self, under: str) -> list[tuple[str, float]]:
        """(key, last-modified unix time) of every object under `prefix + under`."""
        paginator = self.client.get_paginator("list_objects_v2")
        found = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + under):
            for item in page.get("Contents", ()):
                found.append((item["Key"], item["LastModified"].timestamp()))
        return found


class S3Catalog(AdapterCatalog):
    """One JSON object per catalogue row; a PUT replaces a row atomically."""

    def __init__(self, client: Any, bucket: str, prefix: str) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def _key(self, tenant: str, name: str) -> str:
        return f"{self.prefix}catalog/{tenant}/{name}.json"

    def get(self, tenant: str, name: str) -> CatalogEntry | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(tenant, name))["Body"]
        except Exception as error:
            if _missing(error):
                return None
            raise
        return _entry(json.loads(body.read()))

    def list(self, tenant: str | None = None) -> list[CatalogEntry]:
        under = self.prefix + "catalog/" + ("" if tenant is None else f"{tenant}/")
        paginator = self.client.get_paginator("list_objects_v2")
        entries = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=under):
            for item in page.get("Contents", ()):
                tenant_of, name = item["Key"][len(self.prefix) + len("catalog/") :].split("/", 1)
                entry = self.get(tenant_of, name.removesuffix(".json"))
                if entry is not None:  # deleted between the listing and the read
                    entries.append(entry)
        return sorted(entries, key=lambda e: (e.tenant, e.name))

    def put(self, entry: CatalogEntry) -> None:
        body = json.dumps({**entry.__dict__, "modules": list(entry.modules)}).encode()
        self.client.put_object(Bucket=self.bucket, Key=self._key(entry.tenant, entry.name),
                               Body=body, ContentType="application/json")  # fmt: skip

    def delete(self, tenant: str, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(tenant, name))


def _entry(row: dict[str, Any]) -> CatalogEntry:
    return CatalogEntry(
        row["tenant"], row["name"], row["digest"], float(row["created"]), int(row["size"]),
        int(row["rank"]), tuple(row["modules"]),
    )  # fmt: skip


def open_s3_registry(bucket: str, prefix: str, cache_dir: Path):
    """The registry in `s3://bucket/prefix` (boto3's usual settings: AWS_ENDPOINT_URL,
    credentials, region), with downloads cached under `cache_dir`."""
    try:
        import boto3
    except ImportError:
        raise ValueError(
            "an s3:// adapter registry needs boto3: pip install 'loraplex[s3]'"
        ) from None
    from loraplex.adapters.registry import AdapterRegistry

    if prefix and not prefix.endswith("/"):
        prefix += "/"
    client = boto3.client("s3")
    store = S3BlobStore(client, bucket, prefix, cache_dir)
    return AdapterRegistry(cache_dir, store=store, catalog=S3Catalog(client, bucket, prefix))
