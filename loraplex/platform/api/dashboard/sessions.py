"""`DashboardSessions`: the dashboard's login, a signed cookie instead of the admin key.

A browser cannot put `Authorization: Bearer <key>` on a page it navigates to, so the login form
trades the admin key for a cookie: `<expiry>.<HMAC-SHA256(admin key, expiry)>`. Nothing is
stored on the server, so every API server process of a host accepts the same cookie, and a new
admin key ends every session. The cookie is HttpOnly and SameSite=Strict, and it opens only the
dashboard's reads (`GET /dashboard`, `GET /admin/stats`): every other admin route, and anything
that changes state, still takes the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import time

COOKIE = "loraplex_dashboard"
SESSION_TTL_S = 8 * 3600
#: (method, path) pairs a session cookie authenticates
COOKIE_ROUTES = frozenset({("GET", "/dashboard"), ("GET", "/admin/stats")})
_CONTEXT = b"loraplex-dashboard-session:"


class DashboardSessions:
    """Issues and checks session cookies signed with the admin key (None: no admin, no login)."""

    def __init__(self, admin_key: str | None, ttl_s: int = SESSION_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self._secret = admin_key.encode() if admin_key else None
        self.ttl_s = ttl_s

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def issue(self, now: float | None = None) -> str:
        """A new session token, valid for `ttl_s` seconds."""
        if self._secret is None:
            raise ValueError("no admin key: dashboard sessions are off")
        expiry = str(int((time.time() if now is None else now) + self.ttl_s))
        return f"{expiry}.{_sign(self._secret, expiry)}"

    def is_valid(self, token: str | None, now: float | None = None) -> bool:
        """Whether `token` was issued with this admin key and has not expired."""
        if self._secret is None or not token or token.count(".") != 1:
            return False
        expiry, signature = token.split(".")
        if not expiry.isdigit() or not hmac.compare_digest(signature, _sign(self._secret, expiry)):
            return False
        return int(expiry) > (time.time() if now is None else now)

    def authenticates(self, method: str, path: str, cookie_header: str | None) -> bool:
        """Whether a request's `Cookie` header holds a valid session for this route."""
        if (method, path) not in COOKIE_ROUTES or not cookie_header:
            return False
        return self.is_valid(cookie_value(cookie_header, COOKIE))


def _sign(secret: bytes, expiry: str) -> str:
    return hmac.new(secret, _CONTEXT + expiry.encode(), hashlib.sha256).hexdigest()


def cookie_value(header: str, name: str) -> str | None:
    """The value of cookie `name` in a `Cookie:` header (first one wins), or None."""
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None
