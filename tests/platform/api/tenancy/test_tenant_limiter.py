"""TenantLimiter on its own: caps count sequences and reserved tokens, released when a response
ends; a request that alone exceeds a cap is refused for good (no Retry-After)."""

from __future__ import annotations

from loraplex.platform.api.tenancy.limits import (
    LimitExceeded,
    Reservation,
    TenantLimiter,
    reservation,
)
from loraplex.platform.api.tenancy.tenant_store import Tenant
from loraplex.platform.core.sampling_params import SamplingParams


def test_sequences_not_requests_count_against_the_concurrency_cap():
    limiter, tenant = TenantLimiter(), Tenant("t", max_concurrent_requests=4)
    first = limiter.try_admit(tenant, num_seqs=3)
    assert isinstance(first, Reservation) and limiter.running("t") == 3
    busy = limiter.try_admit(tenant, num_seqs=2)
    assert isinstance(busy, LimitExceeded) and busy.retry_after_s == 1
    never = limiter.try_admit(tenant, num_seqs=5)
    assert isinstance(never, LimitExceeded) and never.retry_after_s is None
    assert never.param == "n"
    limiter.release(first)
    assert limiter.running("t") == 0
    assert isinstance(limiter.try_admit(tenant, num_seqs=4), Reservation)


def test_reservations_and_charges_share_the_token_budget():
    limiter, tenant = TenantLimiter(), Tenant("t", tokens_per_minute=100)
    held = limiter.try_admit(tenant, num_tokens=60)
    assert isinstance(held, Reservation)
    # 60 reserved + 50 > 100, though nothing has been charged yet.
    assert isinstance(limiter.try_admit(tenant, num_tokens=50), LimitExceeded)
    limiter.charge("t", 30)  # the request finished having used 30 of its 60 ...
    limiter.release(held)  # ... and its response ended
    assert isinstance(limiter.try_admit(tenant, num_tokens=70), Reservation)
    refused = limiter.try_admit(tenant, num_tokens=1)
    assert isinstance(refused, LimitExceeded) and refused.retry_after_s == 1
    too_big = limiter.try_admit(Tenant("u", tokens_per_minute=100), num_tokens=101)
    assert isinstance(too_big, LimitExceeded) and too_big.retry_after_s is None
    assert too_big.param == "max_tokens"


def test_a_spent_budget_says_when_to_retry():
    limiter, tenant = TenantLimiter(), Tenant("t", tokens_per_minute=100)
    limiter.charge("t", 90)
    refused = limiter.try_admit(tenant, num_tokens=20)
    assert isinstance(refused, LimitExceeded)
    assert 59 <= refused.retry_after_s <= 60  # when the 90 tokens age out of the minute


def test_other_tenants_are_unaffected():
    limiter = TenantLimiter()
    limiter.try_admit(Tenant("a", max_concurrent_requests=1, tokens_per_minute=10), 1, 10)
    assert isinstance(limiter.try_admit(Tenant("b"), 100, 10**6), Reservation)


def test_a_reservation_is_n_times_each_prompt_plus_max_tokens():
    params = SamplingParams(n=3, max_tokens=5)
    assert reservation(512, params, [10, 20]) == (6, 3 * (15 + 25))
    # Without max_tokens a sequence may run to the end of the context.
    assert reservation(512, SamplingParams(max_tokens=None), [12]) == (1, 512)
