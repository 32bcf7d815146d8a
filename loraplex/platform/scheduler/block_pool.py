"""BlockPool: reference-counted KV blocks, the prefix-cache map, and LRU eviction.

A block is free when no request holds it. A free block that still carries a hash keeps its
K/V and can be revived by a later request with the same prefix; it is evicted (its hash
dropped) only when a fresh block is needed and it is the least recently freed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], adapter_key: Hashable | None
) -> bytes:
    """Chained hash of one full block: the previous block's hash, its tokens, the adapter.

    NOTE: a cryptographic hash, not Python's `hash`: blocks are shared across tenants by hash
    alone, so a collision would hand one tenant another's K/V.
    """
    h = hashlib.sha256()
    h.update(parent_hash or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(repr(adapter_key).encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; values unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[KVBlock]) -> int:
        """Drop one reference from each block; blocks reaching zero join the LRU tail in the
        given order (callers pass a request's blocks tail-first, so its tail evicts first).
        Returns how many blocks became free."""
        num_freed = 0
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                num_freed += 1
        return num_freed

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block under its hash (first writer wins; duplicates stay private)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id

    def reset_prefix_cache(self) -> None:
        for block_hash, block_id in list(self._cached.items()):
            if self.blocks[block_id].ref_cnt == 0:
                self.blocks[block_id].block_hash = None
                del self._cached[block_hash]
