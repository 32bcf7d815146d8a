"""BlockPool: allocation until the pool runs out, reference counts on shared blocks, the
prefix-cache map (first writer wins), and eviction of freed cached blocks in LRU order."""

from __future__ import annotations

import pytest

from loraplex.platform.scheduler.block_pool import BlockPool, KVBlock, hash_block_tokens


def _cached_pool(num_blocks: int) -> tuple[BlockPool, list[KVBlock], list[bytes]]:
    """A pool whose every block was allocated and published under its own hash (h0, h1, ...)."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_blocks)
    hashes = [hash_block_tokens(None, [i] * 4, None) for i in range(num_blocks)]
    for block, block_hash in zip(blocks, hashes):
        pool.cache_block(block, block_hash)
    return pool, blocks, hashes


def test_allocation_hands_out_distinct_blocks_until_the_pool_is_exhausted():
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert len({b.block_id for b in first}) == 3 and all(b.ref_cnt == 1 for b in first)
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError, match="cannot allocate 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1  # a refused allocation takes nothing
    [last] = pool.allocate(1)
    assert last.block_id not in {b.block_id for b in first}
    with pytest.raises(ValueError):
        pool.allocate(1)


@pytest.mark.parametrize(
    "free_order",
    [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]],  # [3, 2, 1, 0]: a request frees tail-first
)
def test_freed_cached_blocks_are_reused_least_recently_freed_first(free_order):
    pool, blocks, hashes = _cached_pool(4)
    for i in free_order:
        pool.free([blocks[i]])
    assert all(pool.get_cached_block(h) is not None for h in hashes)  # still revivable
    for step, expected in enumerate(free_order, start=1):
        [block] = pool.allocate(1)
        assert block is blocks[expected]
        assert block.block_hash is None and pool.get_cached_block(hashes[expected]) is None
        still_cached = {i for i in range(4) if pool.get_cached_block(hashes[i]) is not None}
        assert still_cached == set(free_order[step:])  # only the evicted block lost its hash


def test_a_revived_block_leaves_the_free_list_and_is_not_evicted():
    pool, blocks, hashes = _cached_pool(3)
    pool.free(blocks)  # LRU: 0, 1, 2
    pool.touch([pool.get_cached_block(hashes[0])])  # a new request hits block 0's prefix
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    assert pool.allocate(2) == [blocks[1], blocks[2]]  # 0, the oldest freed, survives
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_a_shared_block_is_freed_only_when_its_last_user_frees_it():
    pool, blocks, _ = _cached_pool(2)
    shared = blocks[0]
    pool.touch([shared, shared])  # two more requests share the prefix block
    assert shared.ref_cnt == 3
    for users_left in (2, 1):
        pool.free([shared])
        assert shared.ref_cnt == users_left and pool.num_free_blocks == 0
    pool.free([shared])
    assert shared.ref_cnt == 0 and pool.num_free_blocks == 1
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        pool.free([shared])


def test_the_first_writer_of_a_hash_wins_and_duplicates_stay_private():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    key = hash_block_tokens(None, [1, 2, 3, 4], None)
    pool.cache_block(a, key)
    pool.cache_block(b, key)  # the same content computed twice
    assert pool.get_cached_block(key) is a and b.block_hash is None
    pool.cache_block(a, hash_block_tokens(None, [9, 9, 9, 9], None))  # a keeps its first hash
    assert a.block_hash == key
    uncached = BlockPool(1, enable_caching=False)
    [d] = uncached.allocate(1)
    uncached.cache_block(d, key)
    assert uncached.get_cached_block(key) is None and c.block_hash is None


def test_reset_forgets_the_free_cached_blocks_only():
    pool, blocks, hashes = _cached_pool(3)
    pool.free([blocks[0], blocks[1]])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(hashes[0]) is None and pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[2]) is blocks[2]  # still held by its request


@pytest.mark.parametrize(
    ("parent", "tokens", "adapter"),
    [
        (b"other-parent", [1, 2, 3, 4], None),
        (None, [1, 2, 3, 5], None),
        (None, [1, 2, 3, 4], ("default", "lora-a")),
        (None, [1, 2, 3, 4], ("tenant-b", None)),
    ],
)
def test_a_block_hash_depends_on_its_parent_tokens_and_adapter(parent, tokens, adapter):
    base = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert hash_block_tokens(None, [1, 2, 3, 4], None) == base
    assert hash_block_tokens(parent, tokens, adapter) != base


def test_a_pool_needs_a_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
