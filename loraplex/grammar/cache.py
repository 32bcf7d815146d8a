"""`GrammarCache`: compiled indexes by key, in memory (LRU by size) and optionally on disk."""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path


class GrammarCache:
    """Thread-safe store of compiled index bytes keyed by `CompileRequest.key(fingerprint)`.

    The memory tier evicts least recently used entries past `max_bytes`. The disk tier (when
    `directory` is given) keeps every entry as `<key>.index`, written atomically, so a restart
    compiles nothing it compiled before. Files hold `Index.from_binary` data, never pickles.
    """

    def __init__(self, max_bytes: int, directory: Path | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.directory = directory
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.disk_hits = 0
        self.misses = 0

    def get(self, key: str) -> bytes | None:
        """The index bytes for `key`, from memory or disk; None when never compiled."""
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return data
        data = self._read_disk(key)
        with self._lock:
            if data is None:
                self.misses += 1
                return None
            self.disk_hits += 1
            self._remember(key, data)
        return data

    def has(self, key: str) -> bool:
        """True when `key` is stored in memory or on disk (no read, no counters)."""
        with self._lock:
            if key in self._entries:
                return True
        return self.directory is not None and self._path(key).exists()

    def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key` in memory and, if enabled, on disk."""
        with self._lock:
            self._remember(key, data)
        if self.directory is not None:
            self._write_disk(key, data)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _remember(self, key: str, data: bytes) -> None:
        if key in self._entries:
            self._bytes -= len(self._entries.pop(key))
        if len(data) > self.max_bytes:
            return
        self._entries[key] = data
        self._bytes += len(data)
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted)

    def _path(self, key: str) -> Path:
        if not key.isalnum():
            raise ValueError(f"cache keys are hex digests, got {key!r}")
        return self.directory / f"{key}.index"

    def _read_disk(self, key: str) -> bytes | None:
        if self.directory is None:
            return None
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _write_disk(self, key: str, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as stream:
                stream.write(data)
            os.replace(temporary, self._path(key))
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
