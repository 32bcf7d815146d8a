"""TenantLimits: each tenant's caps, held for the whole server in the one place every request
passes through — the engine loop — whichever API process sent it.

Both caps count sequences, not HTTP requests: an engine request of `n` samples runs `n`
sequences and reserves `n * (prompt tokens + max_tokens)` of the minute's budget while it runs
(`TenantReservation`, computed by the API process that sent it). A finished request is charged
what it used (prompt and generated tokens) and its reservation dropped. A request is admitted
only if its tenant's sequences in flight plus its own fit the concurrency cap, and the last
minute's charges, the reservations in flight and its own fit the token budget; otherwise it is
refused with `TenantLimitExceeded`, which says when to retry. A request that exceeds a cap on
its own is the API process's to refuse (it sees every prompt of an HTTP request at once).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from loraplex.platform.core.errors import TenantLimitExceeded
from loraplex.platform.core.tenant_caps import TenantReservation

WINDOW_S = 60.0


class TenantLimits:
    """Admission under tenants' caps; called on the engine loop's thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, tuple[str, TenantReservation]] = {}  # request id -> its hold
        self._running: dict[str, int] = {}  # tenant -> sequences in flight
        self._reserved: dict[str, int] = {}  # tenant -> tokens reserved in flight
        self._charged: dict[str, deque[tuple[float, int]]] = {}  # tenant -> (time, tokens)

    def admit(self, request_id: str, tenant: str, reservation: TenantReservation) -> None:
        """Hold `reservation` for `request_id` until `finish` / `release`; raises
        TenantLimitExceeded (with a retry delay) when the tenant's caps are busy."""
        running = self._running.get(tenant, 0)
        reserved = self._reserved.get(tenant, 0)
        if not reservation.continuation:
            self._check(tenant, reservation, running, reserved)
        self._held[request_id] = (tenant, reservation)
        self._running[tenant] = running + reservation.num_seqs
        self._reserved[tenant] = reserved + reservation.num_tokens

    def finish(self, request_id: str, tokens_used: int) -> None:
        """The request ended having used `tokens_used` tokens: charge them to its tenant's
        minute, drop its reservation (nothing for a request admitted without one)."""
        held = self._held.get(request_id)
        if held is None:
            return
        self.release(request_id)
        tenant, reservation = held
        if tokens_used > 0 and reservation.caps.tokens_per_minute is not None:
            # NOTE: the window drops what aged out as it grows, so it holds one minute's charges
            self._window(tenant).append((self._clock(), tokens_used))

    def release(self, request_id: str) -> None:
        """Drop what the request held, charging nothing (it failed, or was never added)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        tenant, reservation = held
        self._running[tenant] -= reservation.num_seqs
        self._reserved[tenant] -= reservation.num_tokens
        if not self._running[tenant]:
            del self._running[tenant], self._reserved[tenant]

    def running(self, tenant: str) -> int:
        """The tenant's sequences in flight (admitted with a reservation, not finished)."""
        return self._running.get(tenant, 0)

    def _check(
        self, tenant: str, reservation: TenantReservation, running: int, reserved: int
    ) -> None:
        caps, num_seqs, num_tokens = reservation.caps, reservation.num_seqs, reservation.num_tokens
        cap = caps.max_concurrent_requests
        if cap is not None and running + num_seqs > cap:
            raise TenantLimitExceeded(
                f"tenant {tenant!r} has {running} sequences running, its limit is {cap}; this "
                f"request needs {num_seqs}",
                retry_after_s=1,
            )
        tpm = caps.tokens_per_minute
        if tpm is None:
            return
        window = self._window(tenant)
        used = sum(n for _, n in window)
        if used + reserved + num_tokens > tpm:
            retry = 1 if reserved else self._retry_after(window, used + num_tokens - tpm)
            raise TenantLimitExceeded(
                f"tenant {tenant!r} used {used} tokens in the last minute and has {reserved} "
                f"reserved by running requests; this request may use {num_tokens}, its limit "
                f"is {tpm} per minute",
                retry_after_s=retry,
            )

    def _window(self, tenant: str) -> deque[tuple[float, int]]:
        window = self._charged.setdefault(tenant, deque())
        start = self._clock() - WINDOW_S
        while window and window[0][0] <= start:
            window.popleft()
        return window

    def _retry_after(self, window: deque[tuple[float, int]], excess: int) -> int:
        """Seconds until at least `excess` of the window's tokens have aged out."""
        now = self._clock()
        freed = 0
        for stamp, tokens in window:
            freed += tokens
            if freed >= excess:
                return max(1, math.ceil(stamp + WINDOW_S - now))
        return int(WINDOW_S)
