"""The waiting queue: FIFO within a tenant, weighted fair queuing across tenants.

Each tenant is charged for the tokens of the requests it gets admitted, divided by its weight;
the next request comes from the tenant charged least so far. With one tenant this is plain
FIFO. A tenant that arrives after a quiet spell starts level with the least-charged busy
tenant, so idleness earns no credit to flood with later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from loraplex.platform.core.request import Request


class FairRequestQueue:
    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}
        self._charge: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _queue(self, tenant: str) -> deque[Request]:
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        if not queue:
            busy = [self._charge[t] for t, q in self._queues.items() if q and t in self._charge]
            floor = min(busy) if busy else 0.0
            self._charge[tenant] = max(self._charge.get(tenant, 0.0), floor)
        return queue

    def push(self, request: Request) -> None:
        self._queue(request.tenant).append(request)
        self._len += 1

    def push_front(self, request: Request) -> None:
        self._queue(request.tenant).appendleft(request)
        self._len += 1

    def _next_tenant(self, exclude: Collection[str] = ()) -> str:
        best, best_key = None, None
        for tenant, queue in self._queues.items():
            if not queue or tenant in exclude:
                continue
            key = (self._charge.get(tenant, 0.0), queue[0].arrival_time)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        if best is None:
            raise IndexError("the waiting queue is empty")
        return best

    def peek(self, exclude: Collection[str] = ()) -> Request:
        """The next request, passing over the tenants in `exclude` (IndexError if none)."""
        return self._queues[self._next_tenant(exclude)][0]

    def pop(self, charge: bool = True, exclude: Collection[str] = ()) -> Request:
        """Take the next request (as `peek`); `charge=False` when it is only set aside for
        this step."""
        tenant = self._next_tenant(exclude)
        request = self._queues[tenant].popleft()
        if charge and request.num_preemptions == 0:  # a resumed request was charged already
            weight = self.weights.get(tenant, 1.0)
            cost = request.num_tokens + request.max_tokens
            self._charge[tenant] = self._charge.get(tenant, 0.0) + cost / weight
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)
        self._len -= 1

    def __iter__(self):
        for queue in self._queues.values():
            yield from queue
