"""TenantLimits, the engine loop's count of tenants' caps: sequences in flight and the minute's
token budget (reservations in flight plus what finished requests used), for every API process."""

from __future__ import annotations

import pytest

from loraplex.platform.core.errors import TenantLimitExceeded
from loraplex.platform.core.tenant_caps import TenantCaps, TenantReservation
from loraplex.platform.engine.tenant_limits import WINDOW_S, TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hold(caps: TenantCaps, seqs: int = 1, tokens: int = 0, **kw) -> TenantReservation:
    return TenantReservation(caps, seqs, tokens, **kw)


def test_sequences_in_flight_count_against_the_concurrency_cap():
    limits, caps = TenantLimits(), TenantCaps(max_concurrent_requests=4)
    limits.admit("a", "t", hold(caps, 3))
    assert limits.running("t") == 3
    with pytest.raises(TenantLimitExceeded) as busy:
        limits.admit("b", "t", hold(caps, 2))
    assert busy.value.retry_after_s == 1
    assert limits.running("t") == 3  # a refused request holds nothing
    limits.admit("c", "t", hold(caps, 1))
    limits.finish("a", 10)
    limits.release("c")
    assert limits.running("t") == 0
    limits.admit("d", "t", hold(caps, 4))


def test_reservations_and_charges_share_the_token_budget():
    clock = Clock()
    limits, caps = TenantLimits(clock), TenantCaps(tokens_per_minute=100)
    limits.admit("a", "t", hold(caps, tokens=60))
    with pytest.raises(TenantLimitExceeded):  # 60 reserved + 50 > 100, nothing charged yet
        limits.admit("b", "t", hold(caps, tokens=50))
    limits.finish("a", 30)  # it used 30 of its 60
    limits.admit("c", "t", hold(caps, tokens=70))
    with pytest.raises(TenantLimitExceeded) as refused:
        limits.admit("d", "t", hold(caps, tokens=1))
    assert refused.value.retry_after_s == 1  # a reservation in flight will end soon


def test_a_spent_budget_says_when_to_retry_and_recovers_after_a_minute():
    clock = Clock()
    limits, caps = TenantLimits(clock), TenantCaps(tokens_per_minute=100)
    limits.admit("a", "t", hold(caps, tokens=90))
    limits.finish("a", 90)
    clock.now += 5
    with pytest.raises(TenantLimitExceeded) as refused:
        limits.admit("b", "t", hold(caps, tokens=20))
    assert refused.value.retry_after_s == 55  # when the 90 tokens age out of the minute
    clock.now += WINDOW_S
    limits.admit("b", "t", hold(caps, tokens=20))


def test_a_continuation_is_counted_and_never_refused():
    limits, caps = TenantLimits(), TenantCaps(max_concurrent_requests=1)
    limits.admit("first", "t", hold(caps))
    limits.admit("phase-2", "t", hold(caps, continuation=True))
    assert limits.running("t") == 2
    with pytest.raises(TenantLimitExceeded):
        limits.admit("other", "t", hold(caps))


def test_other_tenants_and_unknown_ids_are_unaffected():
    limits = TenantLimits()
    limits.admit("a", "t", hold(TenantCaps(max_concurrent_requests=1, tokens_per_minute=10), 1, 10))
    limits.admit("b", "u", hold(TenantCaps(max_concurrent_requests=100), 100))
    limits.finish("never-admitted", 50)
    limits.release("never-admitted")
    assert (limits.running("t"), limits.running("u")) == (1, 100)
