"""Tenants' fair shares of the KV cache and the running batch, and who is over theirs.

A busy tenant (one with a request running or waiting) is entitled to `weight / W` of the KV
blocks and of the sequence slots, W the sum of the busy tenants' weights. A tenant may run
past its share while capacity is idle; when capacity runs short the tenant furthest over its
share gives it back first, and a tenant under its share may take back what others borrowed.
The scheduler decides which request yields (the tenant's newest); this only says which tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


class TenantShares:
    def __init__(
        self,
        weights: Mapping[str, float],
        kv_blocks: Mapping[str, int],
        num_blocks: int,
        max_num_seqs: int,
    ) -> None:
        self.weights = weights  # NOTE: the waiting queue's: one weight per tenant for both
        self.kv_blocks = kv_blocks  # blocks in use per tenant (the KV cache manager's)
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.num_running: dict[str, int] = {}
        self._num_requests: dict[str, int] = {}  # unfinished requests of each busy tenant

    # -- bookkeeping ------------------------------------------------------------------------

    def add_request(self, tenant: str) -> None:
        _count(self._num_requests, tenant, 1)

    def remove_request(self, tenant: str) -> None:
        _count(self._num_requests, tenant, -1)

    def started(self, tenant: str) -> None:
        """One more of the tenant's requests runs."""
        _count(self.num_running, tenant, 1)

    def stopped(self, tenant: str) -> None:
        """One of the tenant's running requests stopped running (finished or preempted)."""
        _count(self.num_running, tenant, -1)

    def clear_running(self) -> None:
        self.num_running.clear()

    # -- shares -------------------------------------------------------------------------------

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _fraction(self, tenant: str) -> float:
        """The tenant's fraction of capacity among the busy tenants (itself counted busy)."""
        total = sum(self.weight(t) for t in self._num_requests)
        if tenant not in self._num_requests:
            total += self.weight(tenant)
        return self.weight(tenant) / total

    def kv_share(self, tenant: str) -> float:
        return self.num_blocks * self._fraction(tenant)

    def seq_share(self, tenant: str) -> float:
        return self.max_num_seqs * self._fraction(tenant)

    def within_share(self, tenant: str, num_blocks: int, num_seqs: int) -> bool:
        """Whether the tenant stays within both shares with this many more blocks and seqs."""
        fraction = self._fraction(tenant)
        blocks = self.kv_blocks.get(tenant, 0) + num_blocks
        seqs = self.num_running.get(tenant, 0) + num_seqs
        return blocks <= self.num_blocks * fraction and seqs <= self.max_num_seqs * fraction

    def kv_excess(self, tenant: str) -> float:
        """Blocks the tenant holds beyond its KV share (negative: under it)."""
        return self.kv_blocks.get(tenant, 0) - self.kv_share(tenant)

    def seq_excess(self, tenant: str) -> float:
        """Running sequences beyond the tenant's share of slots (negative: under it)."""
        return self.num_running.get(tenant, 0) - self.seq_share(tenant)

    # -- who yields ---------------------------------------------------------------------------

    def kv_victim(self, tenant: str, need: int) -> str:
        """The running tenant that yields KV blocks when `tenant` needs `need` more: the one
        holding the most for its weight, counting `tenant`'s need (so the tenant that asks
        yields on a tie); then the one running the most sequences for its weight."""
        best, best_key = tenant, None
        for other, running in self.num_running.items():
            weight = self.weight(other)
            asks = other == tenant
            blocks = self.kv_blocks.get(other, 0) + (need if asks else 0)
            key = (blocks / weight, asks, running / weight, other)
            if best_key is None or key > best_key:
                best, best_key = other, key
        return best

    def kv_lender(self, borrower: str) -> str | None:
        """The tenant other than `borrower` furthest over its KV share, if any is over it."""
        return self._lender(borrower, self.kv_excess)

    def seq_lender(self, borrower: str) -> str | None:
        """The tenant other than `borrower` furthest over its share of the sequence slots, if
        any is over it."""
        return self._lender(borrower, self.seq_excess)

    def _lender(self, borrower: str, excess: Callable[[str], float]) -> str | None:
        best, best_key = None, 0.0
        for tenant in self.num_running:
            if tenant != borrower:
                # NOTE: excess over weight orders tenants as usage over weight does.
                key = excess(tenant) / self.weight(tenant)
                if key > best_key:
                    best, best_key = tenant, key
        return best

    def reclaimable_blocks(self, exclude: str) -> float:
        """Blocks the tenants other than `exclude` hold beyond their KV shares."""
        return sum(max(self.kv_excess(t), 0.0) for t in self.num_running if t != exclude)


def _count(counts: dict[str, int], tenant: str, delta: int) -> None:
    """Move a tenant's count by `delta`; a count reaching zero leaves the dict."""
    left = counts.get(tenant, 0) + delta
    if left:
        counts[tenant] = left
    else:
        del counts[tenant]
