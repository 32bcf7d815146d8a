"""`AdapterBlobStore`: where adapters' files live, content-addressed by their digest.

A digest names a folder of the two PEFT files (`adapter_config.json`,
`adapter_model.safetensors`) and, for an adapter with its own tokenizer, its tokenizer files
(`adapter_tokenizer.TOKENIZER_FILES`). The contract every store keeps:

- `put(digest, staging)` makes the folder visible whole or not at all: a writer killed at any
  point leaves at most unreferenced leftovers, never a torn folder under the digest's name;
- `materialize(digest)` returns a local folder the engine can read, verified against the digest
  (a store on another machine downloads it into a local cache first);
- `collect_garbage` deletes folders no catalogue row references. A store shared by several
  replicas deletes only folders (and staging leftovers) older than `grace_s`: another replica
  may have put one a moment ago and not yet written its catalogue row.

`LocalBlobStore` is a folder: this machine's data folder, or a folder on a filesystem every
replica mounts (NFS, CephFS, EFS...), where a rename within the filesystem is atomic.
`S3BlobStore` (in `s3_registry`) keeps the files in an S3-compatible object store.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path

from loraplex.adapters.adapter_tokenizer import TOKENIZER_FILES, tokenizer_files
from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, content_digest

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
#: every file a stored adapter may hold: the two PEFT files, then its tokenizer's
STORED_FILES = ADAPTER_FILES + TOKENIZER_FILES
#: how old an unreferenced folder or staging leftover of a shared store must be to be deleted
SHARED_GRACE_S = 3600.0


def stored_digest(folder: Path) -> str | None:
    """The content digest of a folder's adapter files (its tokenizer's too), None if they
    cannot be read."""
    try:
        return content_digest(
            (folder / CONFIG_FILE).read_bytes(),
            (folder / WEIGHTS_FILE).read_bytes(),
            tokenizer_files(folder),
        )
    except OSError:
        return None


def present_files(folder: Path) -> list[str]:
    """The names of `STORED_FILES` the folder holds."""
    return [name for name in STORED_FILES if (folder / name).is_file()]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(folder: Path) -> None:
    """Flush the adapter files of `folder` to stable storage."""
    for name in present_files(folder):
        with open(folder / name, "rb") as handle:
            os.fsync(handle.fileno())


class AdapterBlobStore(ABC):
    """Content-addressed adapter folders (see the module docstring for the contract)."""

    def __init__(self, root: Path, tmp: Path, grace_s: float) -> None:
        self.root = root  # the local folder of `<digest>/` folders (a cache for remote stores)
        self.tmp = tmp
        self.grace_s = grace_s
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)

    @property
    def shared(self) -> bool:
        """Whether other replicas use this store too (leftovers get `grace_s` to be claimed)."""
        return self.grace_s > 0

    def new_staging_dir(self) -> Path:
        """A fresh local folder to write an upload into (deleted on recovery if left)."""
        path = self.tmp / f"upload-{uuid.uuid4().hex}"
        path.mkdir()
        return path

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def recover(self) -> None:
        """Delete staging leftovers of crashed writers (in a shared store, only old ones)."""
        cutoff = time.time() - self.grace_s
        for leftover in self.tmp.iterdir():
            try:
                if not self.shared or leftover.stat().st_mtime < cutoff:
                    shutil.rmtree(leftover, ignore_errors=True)
            except FileNotFoundError:
                pass  # another replica's recovery took it

    @abstractmethod
    def put(self, digest: str, staging: Path) -> None:
        """Store the staging folder's files under `digest`, atomically; consumes it.

        If a complete, valid copy is already stored, the staging folder is dropped; a stored
        copy whose files no longer hash to `digest` (damaged) is replaced."""

    @abstractmethod
    def materialize(self, digest: str) -> Path:
        """A local folder holding the verified files of `digest`; FileNotFoundError if the
        store has no complete copy."""

    @abstractmethod
    def local_path(self, digest: str) -> Path:
        """Where `materialize` puts (or finds) `digest`, whether or not it is there yet."""

    @abstractmethod
    def digests(self) -> set[str]:
        """Digests stored complete."""

    @abstractmethod
    def collect_garbage(self, used: set[str]) -> None:
        """Delete stored folders whose digest is not in `used` (shared: only old ones)."""


class LocalBlobStore(AdapterBlobStore):
    """Folders `<root>/<digest>/` on a filesystem, staged in `tmp` on the same filesystem and
    renamed into place (atomic on POSIX filesystems, local or network)."""

    def __init__(self, root: Path, tmp: Path, shared: bool = False) -> None:
        super().__init__(root, tmp, SHARED_GRACE_S if shared else 0.0)

    def put(self, digest: str, staging: Path) -> None:
        fsync_files(staging)
        blob = self.root / digest
        if blob.is_dir() and stored_digest(blob) == digest:
            self.discard(staging)
            return
        for extra in staging.iterdir():
            if extra.name not in STORED_FILES:
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
        damaged = None
        if blob.is_dir():
            # NOTE: files that no longer hash to their name (damaged on disk): the upload of
            # the same content replaces them.
            damaged = self.tmp / f"damaged-{uuid.uuid4().hex}"
            os.rename(blob, damaged)
        try:
            os.rename(staging, blob)
        except OSError:
            if not (blob.is_dir() and stored_digest(blob) == digest):
                raise
            self.discard(staging)  # another replica put the same content first
        _fsync_dir(self.root)
        if damaged is not None:
            shutil.rmtree(damaged, ignore_errors=True)

    def materialize(self, digest: str) -> Path:
        blob = self.root / digest
        if not blob.is_dir():
            raise FileNotFoundError(f"no stored adapter {digest}")
        return blob

    def local_path(self, digest: str) -> Path:
        return self.root / digest

    def digests(self) -> set[str]:
        return {p.name for p in self.root.iterdir() if p.is_dir()}

    def collect_garbage(self, used: set[str]) -> None:
        cutoff = time.time() - self.grace_s
        for blob in self.root.iterdir():
            if blob.name in used:
                continue
            try:
                if not self.shared or blob.stat().st_mtime < cutoff:
                    shutil.rmtree(blob, ignore_errors=True)
            except FileNotFoundError:
                pass
