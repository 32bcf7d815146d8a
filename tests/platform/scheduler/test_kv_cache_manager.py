"""KVCacheManager: a new request reuses the full blocks of an identical prefix (same tenant,
same adapter), shares them by reference, keeps them cached after its owner is done, evicts the
least recently freed first, and is refused (nothing taken) when the pool cannot hold it."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from loraplex.platform.core.request import Request
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.scheduler.kv_cache_manager import KVCacheManager

BLOCK = 4
PROMPT = list(range(100, 112))  # 12 tokens: three full blocks


def _request(
    req_id: str,
    prompt: list[int],
    tenant: str = "default",
    adapter_key: Hashable | None = None,
    **params: object,
) -> Request:
    sampling = SamplingParams(max_tokens=4, **params)  # type: ignore[arg-type]
    return Request(req_id, prompt, sampling, (0,), max_tokens=4, tenant=tenant,
                   adapter_key=adapter_key)  # fmt: skip


def _admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does for a new request: look up its prefix, then allocate the rest."""
    blocks, hit = kv.get_computed_blocks(request)
    return kv.allocate_slots(request, request.num_tokens - hit, blocks)


@pytest.mark.parametrize(
    ("prompt", "hit_tokens"),
    [
        (PROMPT + [7], 12),  # every full block of the shared prefix
        (PROMPT, 8),  # one token is always left to compute (its logits are sampled)
        (PROMPT[:10] + [7, 7, 7], 8),  # the block holding the first difference is not shared
        (PROMPT[:7] + [7] * 6, 4),
        (PROMPT[:3] + [7] * 10, 0),  # a partial block never hits
        ([7] + PROMPT, 0),  # blocks are keyed by everything before them too
    ],
)
def test_a_new_request_reuses_the_full_blocks_of_an_identical_prefix(prompt, hit_tokens):
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = _request("first", PROMPT)
    _admit(kv, first)
    second = _request("second", prompt)
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == hit_tokens and len(blocks) == hit_tokens // BLOCK
    assert kv.allocate_slots(second, second.num_tokens - hit, blocks) is not None
    shared = hit_tokens // BLOCK
    assert kv.block_ids("second")[:shared] == kv.block_ids("first")[:shared]  # the same blocks
    assert not set(kv.block_ids("second")[shared:]) & set(kv.block_ids("first"))
    assert kv.stats.hits == hit_tokens


@pytest.mark.parametrize(
    ("tenant", "adapter_key", "hit_tokens"),
    [
        ("default", "lora-a", 8),
        ("default", "lora-b", 0),  # the same tokens under another adapter
        ("default", None, 0),  # ... or under the base model
        ("other", "lora-a", 0),  # ... or sent by another tenant
    ],
)
def test_the_tenant_and_the_adapter_are_part_of_the_key(tenant, adapter_key, hit_tokens):
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    _admit(kv, _request("first", PROMPT, adapter_key="lora-a"))
    second = _request("second", PROMPT, tenant=tenant, adapter_key=adapter_key)
    assert kv.get_computed_blocks(second)[1] == hit_tokens


def test_shared_blocks_stay_held_until_their_last_user_frees_them_and_stay_cached_after():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first, second = _request("first", PROMPT + [1]), _request("second", PROMPT + [2])
    _admit(kv, first)
    free_after_first = kv.num_free_blocks  # 8 - 4 (three full blocks and a partial one)
    _admit(kv, second)
    assert kv.num_free_blocks == free_after_first - 1  # only its own last block is new
    kv.free(first)
    assert kv.num_free_blocks == free_after_first - 1 + 1  # the shared three are still held
    kv.free(second)
    assert kv.num_free_blocks == 8
    third = _request("third", PROMPT + [3])
    assert kv.get_computed_blocks(third)[1] == 12  # freed, yet still served from the cache


@pytest.mark.parametrize(("evicted", "hit_tokens"), [(0, 12), (1, 8), (2, 4), (3, 0)])
def test_a_freed_prefix_is_evicted_from_its_tail(evicted, hit_tokens):
    """A pool of exactly three blocks: the first request's prefix is freed, then other
    requests take `evicted` blocks; what is left of the prefix still hits."""
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    first = _request("first", PROMPT)
    _admit(kv, first)
    kv.free(first)
    for i in range(evicted):
        assert _admit(kv, _request(f"other{i}", [7 + i] * BLOCK)) is not None
    again = _request("again", PROMPT + [1])
    assert kv.get_computed_blocks(again)[1] == hit_tokens


def test_a_request_the_pool_cannot_hold_is_refused_and_takes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    _admit(kv, _request("first", PROMPT))  # three blocks
    big = _request("big", list(range(8)))  # two blocks, one free
    assert _admit(kv, big) is None
    assert kv.num_free_blocks == 1 and kv.block_ids("big") == []
    small = _request("small", list(range(4)))
    assert _admit(kv, small) is not None and kv.num_free_blocks == 0


def test_reviving_cached_blocks_counts_against_the_free_blocks():
    """A freed prefix sits in the free list: reusing it takes those blocks out again, so a
    request whose hit plus new blocks exceed what is free is refused, hit or not."""
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    first = _request("first", PROMPT)
    _admit(kv, first)
    kv.free(first)
    _admit(kv, _request("filler", [9] * BLOCK))  # takes the never-used block
    wants_more = _request("wants_more", PROMPT + [1] * 5)  # 3 cached blocks + 2 new, 3 free
    blocks, hit = kv.get_computed_blocks(wants_more)
    assert hit == 12
    assert kv.allocate_slots(wants_more, wants_more.num_tokens - hit, blocks) is None
    assert kv.num_free_blocks == 3 and all(b.ref_cnt == 0 for b in blocks)


@pytest.mark.parametrize(
    ("enable_caching", "params"), [(False, {}), (True, {"prompt_logprobs": 0})]
)
def test_no_hits_without_caching_or_for_a_request_scoring_its_whole_prompt(enable_caching, params):
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, enable_caching=enable_caching)
    _admit(kv, _request("first", PROMPT))
    assert kv.get_computed_blocks(_request("second", PROMPT + [1], **params)) == ([], 0)
