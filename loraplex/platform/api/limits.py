"""Per-tenant caps: concurrent requests, and tokens per minute over a sliding window.

Tokens are charged as the engine reports them (prompt and generated tokens of each finished
request); a tenant over its per-minute budget is refused until enough of the last minute's
tokens age out. The concurrency cap bounds how far a tenant can overshoot in between.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from loraplex.platform.api.tenants import Tenant

WINDOW_S = 60.0


@dataclass(frozen=True)
class LimitExceeded:
    """Why a request was refused, and when to try again (seconds, for Retry-After)."""

    message: str
    retry_after_s: int


class TenantLimiter:
    """Admission control per tenant; safe to call from the event loop and the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}

    def try_admit(self, tenant: Tenant) -> LimitExceeded | None:
        """Count one more running request of `tenant`, or say why it cannot start now."""
        now = time.monotonic()
        with self._lock:
            running = self._running.get(tenant.name, 0)
            cap = tenant.max_concurrent_requests
            if cap is not None and running >= cap:
                return LimitExceeded(
                    f"tenant {tenant.name!r} has {running} requests running, its limit is {cap}",
                    1,
                )
            tpm = tenant.tokens_per_minute
            if tpm is not None:
                window = self._window(tenant.name, now)
                used = sum(n for _, n in window)
                if used >= tpm:
                    retry = self._retry_after(window, used - tpm, now)
                    return LimitExceeded(
                        f"tenant {tenant.name!r} used {used} tokens in the last minute, its "
                        f"limit is {tpm}",
                        retry,
                    )
            self._running[tenant.name] = running + 1
        return None

    def release(self, tenant: str) -> None:
        with self._lock:
            self._running[tenant] = max(0, self._running.get(tenant, 0) - 1)

    def charge(self, tenant: str, tokens: int) -> None:
        """Record `tokens` used by `tenant` now."""
        if tokens > 0:
            with self._lock:
                self._tokens.setdefault(tenant, deque()).append((time.monotonic(), tokens))

    def running(self, tenant: str) -> int:
        with self._lock:
            return self._running.get(tenant, 0)

    def _window(self, tenant: str, now: float) -> deque[tuple[float, int]]:
        window = self._tokens.setdefault(tenant, deque())
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        return window

    @staticmethod
    def _retry_after(window: deque[tuple[float, int]], excess: int, now: float) -> int:
        """Seconds until enough of the window ages out to bring usage under the limit."""
        freed = 0
        for stamp, tokens in window:
            freed += tokens
            if freed > excess:
                return max(1, math.ceil(stamp + WINDOW_S - now))
        return int(WINDOW_S)
