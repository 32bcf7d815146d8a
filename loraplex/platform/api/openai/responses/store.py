"""`ResponseStore`: stored Responses-API responses, bounded per tenant and isolated by tenant.

A response is kept with the conversation it ends (its input and output as chat messages), so a
later request's `previous_response_id` continues it. Responses live in one SQLite file under the
data folder (`responses.sqlite`, WAL), so every API process of a server (`--api-server-count`)
sees them, and they survive a restart. Each tenant keeps at most `max_per_tenant` responses; the
oldest go first. Another tenant's id is simply not found (a 404 to the client).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MAX_PER_TENANT = 1000
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    body TEXT NOT NULL,
    messages TEXT NOT NULL,
    UNIQUE (tenant, id)
)
"""


@dataclass(frozen=True)
class StoredResponse:
    """A response body as it was returned, and its whole conversation as chat messages."""

    body: dict[str, Any]
    messages: tuple[dict[str, Any], ...]


class ResponseStore:
    """Responses by (tenant, id) in `data_dir/responses.sqlite`, at most `max_per_tenant` per
    tenant (the oldest dropped); thread-safe, and shared by processes over the same folder."""

    def __init__(self, data_dir: str | Path, max_per_tenant: int = DEFAULT_MAX_PER_TENANT) -> None:
        if max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be >= 1, got {max_per_tenant}")
        self.max_per_tenant = max_per_tenant
        root = Path(data_dir)
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            root / "responses.sqlite", check_same_thread=False, isolation_level=None, timeout=30
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        body = json.dumps(stored.body, ensure_ascii=False)
        messages = json.dumps(list(stored.messages), ensure_ascii=False)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO responses (tenant, id, body, messages) "
                    "VALUES (?, ?, ?, ?)",
                    (tenant, response_id, body, messages),
                )
                self._db.execute(
                    "DELETE FROM responses WHERE tenant = ? AND seq NOT IN (SELECT seq FROM "
                    "responses WHERE tenant = ? ORDER BY seq DESC LIMIT ?)",
                    (tenant, tenant, self.max_per_tenant),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response `response_id`, or None (unknown, evicted, or another's)."""
        with self._lock:
            row = self._db.execute(
                "SELECT body, messages FROM responses WHERE tenant = ? AND id = ?",
                (tenant, response_id),
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), tuple(json.loads(row[1])))

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the tenant's response `response_id`; False when there is none (unknown,
        evicted, or another tenant's)."""
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)
            )
        return cursor.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
