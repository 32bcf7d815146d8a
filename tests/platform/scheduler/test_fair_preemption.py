"""Memory pressure shared by fair shares: the tenant over its share of the KV cache
yields first, its newest request first; a preempted request resumes before its tenant's newer
ones; a tenant within its share takes back what another borrowed; one tenant's big batches
never stall another's stream. Counted in steps, against fake model outputs."""

from __future__ import annotations

import pytest

from benchmarks.scheduler_load import Arrival, Attack, FakeEngine, attack, make_scheduler
from loraplex.platform.scheduler.tenant_shares import TenantShares

BS = 4  # tokens per block in the small pools below


def _arrival(req_id: str, tenant: str, prompt_len: int = 7, max_tokens: int = 20) -> Arrival:
    base = 1000 * (1 + sum(map(ord, req_id)))  # no shared prefix between requests
    return Arrival(0, req_id, [base + i for i in range(prompt_len)], max_tokens, tenant)


def _engine(num_blocks: int, *arrivals: Arrival, max_num_seqs: int = 16) -> FakeEngine:
    engine = FakeEngine(
        make_scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_num_seqs)
    )
    for arrival in arrivals:
        engine.add(arrival)
    return engine


def _shares(weights, busy, blocks, running) -> TenantShares:
    shares = TenantShares(weights, blocks, num_blocks=100, max_num_seqs=8)
    for tenant in busy:
        shares.add_request(tenant)
    for tenant, count in running.items():
        for _ in range(count):
            shares.started(tenant)
    return shares


@pytest.mark.parametrize(
    ("weights", "blocks", "running", "asker", "victim"),
    [
        # Equal weights: the tenant holding more blocks yields, whoever asks.
        ({}, {"a": 90, "b": 10}, {"a": 6, "b": 1}, "b", "a"),
        ({}, {"a": 90, "b": 10}, {"a": 6, "b": 1}, "a", "a"),
        # Alice weighs twice bob: her 60 blocks are 30 per unit of weight, his 40 are 40.
        ({"a": 2.0}, {"a": 60, "b": 40}, {"a": 4, "b": 4}, "a", "b"),
        # At par, the tenant that asks for more is the one that yields.
        ({}, {"a": 50, "b": 50}, {"a": 1, "b": 8}, "a", "a"),
        ({}, {"a": 50, "b": 50}, {"a": 1, "b": 8}, "b", "b"),
        # Alone, a tenant yields to itself.
        ({}, {"a": 100}, {"a": 3}, "a", "a"),
    ],
)
def test_the_tenant_furthest_over_its_share_yields_blocks(weights, blocks, running, asker, victim):
    shares = _shares(weights, running, blocks, running)
    assert shares.kv_victim(asker, need=1) == victim


@pytest.mark.parametrize(
    ("weights", "busy", "blocks", "running", "borrower", "kv_lender", "seq_lender"),
    [
        # Bob takes back from alice, past her half of the blocks and of the 8 slots.
        ({}, "ab", {"a": 90, "b": 10}, {"a": 6, "b": 1}, "b", "a", "a"),
        # Alice is under her share: nobody lends to her.
        ({}, "ab", {"a": 90, "b": 10}, {"a": 6, "b": 1}, "a", None, None),
        # Alice weighs twice bob: 60 of 100 blocks and 4 of 8 slots are within her 2/3.
        ({"a": 2.0}, "ab", {"a": 60, "b": 40}, {"a": 4, "b": 4}, "b", None, None),
        # Carol only waits, yet counts: each share is a third (33 blocks, 2.7 slots).
        ({}, "abc", {"a": 50, "b": 40}, {"a": 2, "b": 5}, "c", "a", "b"),
        # Both at their shares: there is nothing to take back.
        ({}, "ab", {"a": 50, "b": 50}, {"a": 4, "b": 4}, "b", None, None),
    ],
)
def test_only_a_tenant_over_its_share_lends(
    weights, busy, blocks, running, borrower, kv_lender, seq_lender
):
    shares = _shares(weights, busy, blocks, running)
    assert shares.kv_lender(borrower) == kv_lender
    assert shares.seq_lender(borrower) == seq_lender


def test_shares_follow_the_busy_tenants_weights():
    shares = TenantShares({"a": 3.0}, {}, num_blocks=100, max_num_seqs=8)
    shares.add_request("a")
    assert shares.kv_share("a") == 100 and shares.kv_share("b") == 25  # b counted busy
    shares.add_request("b")
    assert (shares.kv_share("a"), shares.seq_share("b")) == (75, 2)
    assert shares.within_share("b", 25, 2) and not shares.within_share("b", 26, 0)
    shares.remove_request("a")
    assert shares.kv_share("b") == 100


def test_the_newest_request_of_the_tenant_over_its_share_is_preempted():
    # Four requests of two blocks fill eight blocks; each needs a third two steps later. Bob's
    # request is the newest of all (the old rule preempted it first); alice holds three
    # quarters of the pool against her half, so her newest requests yield, newest first.
    engine = _engine(8, *(_arrival(f"a{i}", "alice") for i in (1, 2, 3)), _arrival("b1", "bob"))
    sched = engine.scheduler
    assert len(engine.step().new_reqs) == 4 and sched.kv.num_free_blocks == 0
    engine.step()
    so = engine.step()
    assert so.finished_req_ids == {"a3", "a2"}  # preempted: the runner forgets them
    assert [r.request_id for r in sched.running] == ["a1", "b1"]
    assert so.num_scheduled_tokens == {"a1": 1, "b1": 1}
    assert sched.kv.tenant_blocks == {"alice": 3, "bob": 3}


def test_a_preempted_request_resumes_before_its_tenants_newer_ones():
    engine = _engine(8, *(_arrival(f"a{i}", "alice") for i in (1, 2, 3)), _arrival("b1", "bob"))
    engine.add(_arrival("a4", "alice", prompt_len=3))
    sched = engine.scheduler
    engine.step()
    engine.step()
    so = engine.step()  # a3 and a2 preempted
    # The step left two blocks free, enough for a4's one: it waits behind a2 and a3.
    assert sched.kv.num_free_blocks == 2 and not so.new_reqs
    waiting = [r.request_id for r in sched.waiting]
    assert waiting == ["a2", "a3", "a4"]
    admitted = []
    while sched.has_unfinished_requests():
        admitted += [r.req_id for r in engine.step().new_reqs]
    assert admitted.index("a2") < admitted.index("a3") < admitted.index("a4")
    assert sched.kv.num_free_blocks == 8 and not sched.kv.tenant_blocks


def test_admission_leaves_room_for_the_running_set_to_grow():
    # After this step three decoding requests sit at block boundaries: their next tokens need
    # three blocks. A waiting request that would take those blocks is not admitted.
    engine = _engine(9, *(_arrival(f"a{i}", "t", prompt_len=3) for i in range(3)))
    engine.step()  # 3 prompt tokens each, one block each
    engine.add(_arrival("late", "t", prompt_len=14))  # four blocks, of the six left
    so = engine.step()  # the fourth token: each request's block is full
    assert not so.new_reqs
    so = engine.step()
    assert sorted(so.num_scheduled_tokens) == ["a0", "a1", "a2"]
    assert engine.scheduler.num_preemptions == 0


def test_a_tenant_within_its_share_takes_back_what_another_borrowed():
    # Alice alone fills an idle pool with twelve requests; bob arrives, and his request is
    # admitted in the next step, alice's newest requests preempted for its blocks.
    alice = [_arrival(f"a{i:02}", "alice", prompt_len=3, max_tokens=30) for i in range(12)]
    engine = _engine(24, *alice)
    sched = engine.scheduler
    for _ in range(6):
        engine.step()
    assert sched.num_running == 12 and sched.kv.num_free_blocks <= 1
    engine.add(_arrival("b1", "bob", prompt_len=11, max_tokens=5))
    so = engine.step()
    assert [r.req_id for r in so.new_reqs] == ["b1"]
    preempted = sorted(so.finished_req_ids)
    assert preempted == [f"a{i:02}" for i in range(12 - len(preempted), 12)]  # the newest
    engine.run([])
    assert engine.trace.ttft("b1") == 1 and engine.trace.worst_gap("b1") == 1
    assert all(engine.trace.finish_reason[a.request_id] == "length" for a in alice)


def test_a_tenant_over_its_share_waits_while_another_is_admitted():
    # Alice's next request needs eight blocks and seven are free: it waits. Bob's request,
    # behind it in the fair queue (both charged alike, alice's older), fits in the free
    # blocks and comes in at once: alice, over her half, does not hold the queue for him.
    alice = [_arrival(f"a{i}", "alice", prompt_len=11) for i in range(3)]
    engine = _engine(16, *alice, _arrival("a3", "alice", prompt_len=30))
    engine.step()
    assert engine.scheduler.num_running == 3 and engine.scheduler.kv.num_free_blocks == 7
    engine.add(_arrival("b1", "bob", prompt_len=3, max_tokens=4))
    so = engine.step()
    assert [r.req_id for r in so.new_reqs] == ["b1"]
    engine.run([])
    assert engine.trace.ttft("b1") == 1
    assert all(engine.trace.finish_reason[f"a{i}"] == "length" for i in range(4))


@pytest.mark.parametrize("bob_first", [True, False], ids=["bob-streams-first", "bob-joins"])
def test_a_tenants_big_batches_do_not_stall_anothers_stream(bob_first):
    """Issue 38's attack, scaled down: bob streams while alice sends two completions of
    16 prompts x n=8 into a pool that holds a fraction of them."""
    setup = Attack(
        stream_tokens=60,
        prompts=16,
        n=8,
        max_tokens=40,
        num_blocks=96,
        max_num_seqs=64,
        stream_step=0 if bob_first else 12,
        batch_step=4 if bob_first else 0,
    )
    figures = attack(setup)
    assert figures.num_preemptions > 0  # the pool is under pressure
    assert figures.unloaded_worst_gap == 1
    assert figures.attacked_worst_gap <= 3 * figures.unloaded_worst_gap, figures
    assert figures.attacked_ttft <= 3, figures
    assert figures.stream_tokens_equal and figures.batch_all_finished, figures
    assert figures.batch_tokens_equal, figures  # preemption changed none of alice's tokens
