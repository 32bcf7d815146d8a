"""`DashboardSessions`: the dashboard's login, a session cookie instead of the admin key.

A browser cannot put `Authorization: Bearer <key>` on a page it navigates to, so the login form
trades the admin key for a cookie holding a random session token. The server keeps each
session's SHA-256 (never the token), the admin key's hash it was issued under, and its expiry in
a table of the data folder's SQLite file (the tenants' file: the shared folder with a file://
registry), so every API process of a server, and every replica sharing the folder, sees the same
sessions: logging out deletes the session everywhere at once, and a session issued under another
admin key (the key was rotated) is refused. The cookie is HttpOnly and SameSite=Strict, and it
opens only the dashboard's reads (`GET /dashboard`, `GET /admin/stats`): every other admin
route, and anything that changes state, still takes the key itself.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import threading
import time
from pathlib import Path

from loraplex.platform.api.tenancy.tenant_store import TENANTS_DB

COOKIE = "loraplex_dashboard"
SESSION_TTL_S = 8 * 3600
#: (method, path) pairs a session cookie authenticates
COOKIE_ROUTES = frozenset({("GET", "/dashboard"), ("GET", "/admin/stats")})
_MAX_TOKEN_CHARS = 128  # a token is 43; anything much longer is not one of ours

_SCHEMA = """
CREATE TABLE IF NOT EXISTS dashboard_sessions (
    token_hash TEXT PRIMARY KEY,
    admin_key_hash TEXT NOT NULL,
    expires REAL NOT NULL
)
"""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class DashboardSessions:
    """Issues, checks and revokes session tokens in `folder`'s SQLite file; with no admin key
    there is no login. Thread-safe."""

    def __init__(
        self, admin_key: str | None, folder: str | Path, ttl_s: int = SESSION_TTL_S
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._admin_hash = _sha256(admin_key) if admin_key else None
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        if self._admin_hash is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                Path(folder) / TENANTS_DB, check_same_thread=False, isolation_level=None
            )
            self._db.execute(_SCHEMA)

    @property
    def enabled(self) -> bool:
        return self._db is not None

    def issue(self, now: float | None = None) -> str:
        """A new session token, valid for `ttl_s` seconds (expired sessions, and those of an
        earlier admin key, are dropped meanwhile)."""
        if self._db is None:
            raise ValueError("no admin key: dashboard sessions are off")
        now = time.time() if now is None else now
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._db.execute(
                "DELETE FROM dashboard_sessions WHERE expires <= ? OR admin_key_hash != ?",
                (now, self._admin_hash),
            )
            self._db.execute(
                "INSERT INTO dashboard_sessions VALUES (?, ?, ?)",
                (_sha256(token), self._admin_hash, now + self.ttl_s),
            )
        return token

    def is_valid(self, token: str | None, now: float | None = None) -> bool:
        """Whether `token` is a live session issued under this admin key."""
        if self._db is None or not token or len(token) > _MAX_TOKEN_CHARS:
            return False
        with self._lock:
            row = self._db.execute(
                "SELECT admin_key_hash, expires FROM dashboard_sessions WHERE token_hash = ?",
                (_sha256(token),),
            ).fetchone()
        if row is None:
            return False
        admin_hash, expires = row
        return secrets.compare_digest(admin_hash, self._admin_hash) and expires > (
            time.time() if now is None else now
        )

    def revoke(self, token: str | None) -> None:
        """End the session `token` (logging out), in every process that shares the folder."""
        if self._db is None or not token or len(token) > _MAX_TOKEN_CHARS:
            return
        with self._lock:
            self._db.execute(
                "DELETE FROM dashboard_sessions WHERE token_hash = ?", (_sha256(token),)
            )

    def authenticates(self, method: str, path: str, cookie_header: str | None) -> bool:
        """Whether a request's `Cookie` header holds a valid session for this route."""
        if (method, path) not in COOKIE_ROUTES or not cookie_header:
            return False
        return self.is_valid(cookie_value(cookie_header, COOKIE))

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


def cookie_value(header: str, name: str) -> str | None:
    """The value of cookie `name` in a `Cookie:` header (first one wins), or None."""
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None
