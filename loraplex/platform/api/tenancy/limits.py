"""Per-tenant caps: concurrent sequences, and tokens per minute over a sliding window.

Both count sequences, not HTTP requests: a request of `p` prompts with `n` samples each runs
`p * n` sequences, and reserves `p * n * (prompt tokens + max_tokens)` of the minute's budget
while it runs. Finished requests charge what the engine reports they used (prompt and generated
tokens); a reservation is dropped when its response ends. A request is admitted only if the
last minute's charges, the reservations in flight and its own reservation fit the budget, so one
request can never take more than the budget.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from loraplex.platform.api.tenancy.tenant_store import Tenant
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.core.sampling_params import SamplingParams

WINDOW_S = 60.0


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds of its tenant's caps until its response ends."""

    tenant: str
    num_seqs: int
    num_tokens: int


def reservation(
    max_model_len: int,
    params: SamplingParams,
    prompt_lengths: list[int],
    defaults: GenerationDefaults | None = None,
) -> tuple[int, int]:
    """(sequences, tokens) a request may use: n samples of each prompt, each up to its prompt
    plus the max_tokens it runs with (without one: the server's default max_tokens, capped at
    the rest of the context, else the rest of the context; see `GenerationDefaults`)."""
    defaults = defaults or GenerationDefaults()
    tokens = 0
    for length in prompt_lengths:
        budget = defaults.max_tokens_for(params.max_tokens, length, max_model_len)
        tokens += length + max(0, budget)
    return params.n * len(prompt_lengths), params.n * tokens


@dataclass(frozen=True)
class LimitExceeded:
    """Why a request was refused, and when to try again (seconds, for Retry-After).

    `retry_after_s` is None when the request exceeds the cap on its own and can never be
    admitted (answered 400, naming `param`, rather than 429)."""

    message: str
    retry_after_s: int | None
    param: str | None = None


class TenantLimiter:
    """Admission control per tenant; safe to call from the event loop and the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}  # sequences of admitted requests
        self._reserved: dict[str, int] = {}  # tokens reserved by admitted requests
        self._tokens: dict[str, deque[tuple[float, int]]] = {}  # (time, tokens) charged

    def try_admit(
        self, tenant: Tenant, num_seqs: int = 1, num_tokens: int = 0
    ) -> Reservation | LimitExceeded:
        """Reserve `num_seqs` sequences and `num_tokens` tokens for `tenant`, or say why not."""
        now = time.monotonic()
        with self._lock:
            running = self._running.get(tenant.name, 0)
            cap = tenant.max_concurrent_requests
            if cap is not None and num_seqs > cap:
                return LimitExceeded(
                    f"the request runs {num_seqs} sequences (n x prompts), more than tenant "
                    f"{tenant.name!r} may run at once ({cap}); lower n or send fewer prompts",
                    None,
                    "n",
                )
            if cap is not None and running + num_seqs > cap:
                return LimitExceeded(
                    f"tenant {tenant.name!r} has {running} sequences running, its limit is "
                    f"{cap}; this request needs {num_seqs}",
                    1,
                )
            tpm = tenant.tokens_per_minute
            reserved = self._reserved.get(tenant.name, 0)
            if tpm is not None:
                if num_tokens > tpm:
                    return LimitExceeded(
                        f"the request may use {num_tokens} tokens (prompt plus max_tokens, per "
                        f"sequence), more than the budget of tenant {tenant.name!r} ({tpm} "
                        "tokens per minute); lower max_tokens or n, or send fewer prompts",
                        None,
                        "max_tokens",
                    )
                window = self._window(tenant.name, now)
                used = sum(n for _, n in window)
                if used + reserved + num_tokens > tpm:
                    retry = 1 if reserved else self._retry_after(window, used + num_tokens - tpm)
                    return LimitExceeded(
                        f"tenant {tenant.name!r} used {used} tokens in the last minute and has "
                        f"{reserved} reserved by running requests; this request may use "
                        f"{num_tokens}, its limit is {tpm} per minute",
                        retry,
                    )
            self._running[tenant.name] = running + num_seqs
            self._reserved[tenant.name] = reserved + num_tokens
        return Reservation(tenant.name, num_seqs, num_tokens)

    def release(self, reservation: Reservation) -> None:
        """Drop what an admitted request held (its response ended)."""
        with self._lock:
            name = reservation.tenant
            self._running[name] = max(0, self._running.get(name, 0) - reservation.num_seqs)
            self._reserved[name] = max(0, self._reserved.get(name, 0) - reservation.num_tokens)

    def charge(self, tenant: str, tokens: int) -> None:
        """Record `tokens` used by `tenant` now."""
        if tokens > 0:
            with self._lock:
                self._tokens.setdefault(tenant, deque()).append((time.monotonic(), tokens))

    def running(self, tenant: str) -> int:
        """Sequences of `tenant`'s admitted requests."""
        with self._lock:
            return self._running.get(tenant, 0)

    def _window(self, tenant: str, now: float) -> deque[tuple[float, int]]:
        window = self._tokens.setdefault(tenant, deque())
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        return window

    @staticmethod
    def _retry_after(window: deque[tuple[float, int]], excess: int) -> int:
        """Seconds until at least `excess` of the window's tokens have aged out."""
        now = time.monotonic()
        freed = 0
        for stamp, tokens in window:
            freed += tokens
            if freed >= excess:
                return max(1, math.ceil(stamp + WINDOW_S - now))
        return int(WINDOW_S)
