"""A tenant's caps as they travel with its requests, so that one place enforces them for the
whole server, however many API processes it has: the engine loop (`engine/tenant_limits.py`).

An API process knows the tenant behind a key and its caps; it sends them with each engine
request it adds, with what that request may use (`TenantReservation`). The loop counts each
tenant's sequences in flight and tokens reserved or used in the last minute across every API
process, and refuses a request over a cap with `TenantLimitExceeded` (a 429 with Retry-After).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantCaps:
    """A tenant's caps (None: no cap)."""

    max_concurrent_requests: int | None = None  # sequences running or queued at once
    tokens_per_minute: int | None = None  # prompt plus generated tokens in any 60 s

    @property
    def capped(self) -> bool:
        return self.max_concurrent_requests is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class TenantReservation:
    """What one engine request holds of its tenant's caps until it finishes: `num_seqs`
    sequences (its n samples) and `num_tokens` tokens of the minute's budget (its prompt plus
    max_tokens, per sample), charged what it really used when it finishes.

    `continuation`: a later phase of a request already admitted (a tool call generated under
    its grammar after free text): counted like any other, never refused."""

    caps: TenantCaps
    num_seqs: int
    num_tokens: int
    continuation: bool = False
