"""The API side of tenants' caps: a request that exceeds a cap on its own is refused for good
(400 naming the field), the caps a request carries to the engine, what each of its engine
requests reserves, and the HTTP answers to the engine's refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loraplex.platform.api.tenancy.limits import (
    check_request,
    limit_error,
    reservation,
    reserve,
)
from loraplex.platform.api.tenancy.tenant_store import Tenant
from loraplex.platform.core.errors import TenantLimitExceeded
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.tenant_caps import TenantCaps, TenantReservation


def test_a_request_over_a_cap_on_its_own_is_refused_for_good():
    tenant = Tenant("t", max_concurrent_requests=4, tokens_per_minute=100)
    assert check_request(tenant, 4, 100) == TenantCaps(4, 100)
    with pytest.raises(TenantLimitExceeded) as seqs:
        check_request(tenant, 5, 10)
    assert (seqs.value.retry_after_s, seqs.value.param) == (None, "n")
    with pytest.raises(TenantLimitExceeded) as tokens:
        check_request(tenant, 1, 101)
    assert (tokens.value.retry_after_s, tokens.value.param) == (None, "max_tokens")
    assert check_request(Tenant("open"), 10**6, 10**9) is None  # no caps: nothing to carry


def test_each_engine_request_reserves_its_own_prompt_plus_max_tokens_per_sample():
    params = SamplingParams(n=3, max_tokens=5)
    assert reservation(512, params, [10, 20]) == (6, 3 * (15 + 25))
    # Without max_tokens a sequence may run to the end of the context.
    assert reservation(512, SamplingParams(max_tokens=None), [12]) == (1, 512)
    caps = TenantCaps(max_concurrent_requests=8)
    engine = SimpleNamespace(max_model_len=512, generation_defaults=GenerationDefaults())
    assert reserve(caps, engine, params, 10) == TenantReservation(caps, 3, 45)
    assert reserve(caps, engine, params, 10, continuation=True).continuation
    assert reserve(None, engine, params, 10) is None
    # A server default max_tokens (the generation config's) is what a request without one holds.
    engine.generation_defaults = GenerationDefaults(max_tokens=100)
    assert reserve(caps, engine, SamplingParams(max_tokens=None), 10).num_tokens == 110


def test_the_engines_refusals_answer_429_with_retry_after_or_400():
    busy = limit_error(TenantLimitExceeded("busy", retry_after_s=7))
    assert busy.status == 429 and busy.headers == {"Retry-After": "7"}
    assert busy.body()["error"]["type"] == "rate_limit_error"
    never = limit_error(TenantLimitExceeded("too big", param="n"))
    assert never.status == 400
    assert never.body()["error"]["code"] == "tenant_limit_exceeded"
    assert never.body()["error"]["param"] == "n"
