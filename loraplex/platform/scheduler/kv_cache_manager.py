"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.platform.core.request import Request
from loraplex.platform.scheduler.block_pool import BlockPool, KVBlock, hash_block_tokens


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_published: dict[str, int] = {}  # leading blocks of a request already hashed
        # Blocks in use per tenant, each counted once however many of its requests hold it.
        # NOTE: exact because cached blocks are keyed by tenant: no block is ever shared
        # between two tenants' requests.
        self.tenant_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` over the full blocks of its first `num_tokens`."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        # NOTE: the tenant is part of the key too: cached prefixes are never shared across
        # tenants (a hit's timing would tell one tenant what another sent).
        scope = (request.tenant, request.adapter_key)
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], scope))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a new request: (blocks, number of tokens they hold).

        At least one token is always left to compute, so the request gets logits to sample;
        a request that asks for prompt logprobs computes its whole prompt.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit = request.num_tokens - 1
        self._update_block_hashes(request, max_hit)
        blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[: max_hit // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_hit = len(blocks) * self.block_size
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit
        return blocks, num_hit

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Returns the ids of newly added blocks (cached prefix blocks first), or None when the
        pool cannot supply them (nothing changes then).
        """
        held = self.req_blocks.get(request.request_id)
        if not computed_blocks:
            total_tokens = request.num_computed_tokens + num_new_tokens
            if held is not None and total_tokens <= len(held) * self.block_size:
                # NOTE: the decode hot path: no new block, at most a newly full one to publish.
                if self.enable_caching:
                    self._cache_full_blocks(request, held, total_tokens)
                return []
            computed_blocks = []
        num_needed, total_tokens = self._num_needed(request, num_new_tokens, computed_blocks)
        # Reviving cached blocks takes them out of the free list too.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(num_needed)
        tenant = request.tenant
        self.tenant_blocks[tenant] = self.tenant_blocks.get(tenant, 0) + num_needed + num_revived
        if held is None:
            held = self.req_blocks[request.request_id] = []
        held.extend(computed_blocks)
        held.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, held, total_tokens)
        return [b.block_id for b in computed_blocks] + [b.block_id for b in new_blocks]

    def num_new_blocks(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> int:
        """Free blocks `allocate_slots` would take for these tokens: fresh ones, and the
        cached prefix blocks it revives."""
        computed_blocks = computed_blocks or []
        num_needed, _ = self._num_needed(request, num_new_tokens, computed_blocks)
        return num_needed + sum(1 for b in computed_blocks if b.ref_cnt == 0)

    def _num_needed(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock]
    ) -> tuple[int, int]:
        """(fresh blocks needed, tokens the request will then hold K/V slots for)."""
        held = self.req_blocks.get(request.request_id)
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_blocks = -(-total_tokens // self.block_size)
        num_needed = num_blocks - (len(held) if held else 0) - len(computed_blocks)
        return max(num_needed, 0), total_tokens

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # NOTE: a block is published once all its tokens are known and scheduled; every token
        # scheduled this step is already in `all_token_ids`, so the hash is final.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_published[request.request_id] = num_full

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        if blocks:
            num_freed = self.pool.free(blocks[::-1])
            left = self.tenant_blocks[request.tenant] - num_freed
            if left:
                self.tenant_blocks[request.tenant] = left
            else:
                del self.tenant_blocks[request.tenant]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
