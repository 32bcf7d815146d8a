"""The grammar cache: LRU by size in memory, files on disk."""

from __future__ import annotations

import pytest

from loraplex.grammar.cache import GrammarCache


def test_memory_tier_evicts_least_recently_used_by_size() -> None:
    cache = GrammarCache(max_bytes=10)
    cache.put("a1", b"1234")
    cache.put("b2", b"1234")
    assert cache.get("a1") == b"1234"  # a1 is now the most recent
    cache.put("c3", b"1234")
    assert cache.get("b2") is None
    assert cache.get("a1") == b"1234" and cache.get("c3") == b"1234"


def test_entry_larger_than_the_budget_is_not_kept_in_memory(tmp_path) -> None:
    cache = GrammarCache(max_bytes=3, directory=tmp_path)
    cache.put("big", b"12345")
    assert len(cache) == 0
    assert cache.get("big") == b"12345"  # still served from disk
    assert cache.disk_hits == 1


def test_disk_tier_is_shared_across_instances(tmp_path) -> None:
    GrammarCache(max_bytes=100, directory=tmp_path).put("abc", b"index")
    assert GrammarCache(max_bytes=100, directory=tmp_path).get("abc") == b"index"
    assert not list(tmp_path.glob("*.tmp"))


def test_keys_must_be_digests(tmp_path) -> None:
    with pytest.raises(ValueError):
        GrammarCache(max_bytes=100, directory=tmp_path).put("../escape", b"x")
