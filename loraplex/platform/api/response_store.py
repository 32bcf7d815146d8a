"""`ResponseStore`: stored Responses-API responses, bounded per tenant and isolated by tenant.

A response is kept with the conversation it ends (its input and output as chat messages), so a
later request's `previous_response_id` continues it. Each tenant keeps at most `max_per_tenant`
responses; the oldest go first. Another tenant's id is simply not found (a 404 to the client).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """A response body as it was returned, and its whole conversation as chat messages."""

    body: dict[str, Any]
    messages: tuple[dict[str, Any], ...]


class ResponseStore:
    """Responses by (tenant, id), at most `max_per_tenant` per tenant (least recent dropped)."""

    def __init__(self, max_per_tenant: int = 1000) -> None:
        if max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be >= 1, got {max_per_tenant}")
        self.max_per_tenant = max_per_tenant
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, stored: StoredResponse) -> None:
        with self._lock:
            kept = self._by_tenant.setdefault(tenant, OrderedDict())
            kept[response_id] = stored
            kept.move_to_end(response_id)
            while len(kept) > self.max_per_tenant:
                kept.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response `response_id`, or None (unknown, evicted, or another's)."""
        with self._lock:
            return self._by_tenant.get(tenant, {}).get(response_id)
