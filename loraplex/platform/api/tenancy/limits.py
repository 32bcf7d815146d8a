"""Per-tenant caps, the API side: concurrent sequences, and tokens per minute over a sliding
window. They hold for the whole server, whichever API process a request lands on: every engine
request carries its tenant's caps and what it reserves of them (`TenantReservation`), and the
engine loop counts them for every API process (`engine/tenant_limits.py`), refusing a request
over a cap with `TenantLimitExceeded` (here: 429 with Retry-After).

Both caps count sequences, not HTTP requests: a request of `p` prompts with `n` samples each runs
`p * n` sequences, and reserves `p * n * (prompt tokens + max_tokens)` of the minute's budget
while it runs; each prompt's engine request holds its own part until it finishes, when the
tenant is charged what it used. A request that exceeds a cap on its own, which no wait would fix,
is refused here (400 naming `param`), where every prompt of it is seen at once.
"""

from __future__ import annotations

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.tenancy.tenant_store import Tenant
from loraplex.platform.core.errors import TenantLimitExceeded
from loraplex.platform.core.generation_defaults import GenerationDefaults
from loraplex.platform.core.sampling_params import SamplingParams
from loraplex.platform.core.tenant_caps import TenantCaps, TenantReservation
from loraplex.platform.engine.protocol import EngineClient


def reservation(
    max_model_len: int,
    params: SamplingParams,
    prompt_lengths: list[int],
    defaults: GenerationDefaults | None = None,
) -> tuple[int, int]:
    """(sequences, tokens) a request may use: n samples of each prompt, each up to its prompt
    plus the max_tokens it runs with (without one: the server's default max_tokens, capped at
    the rest of the context, else the rest of the context; see `GenerationDefaults`)."""
    defaults = defaults or GenerationDefaults()
    tokens = 0
    for length in prompt_lengths:
        budget = defaults.max_tokens_for(params.max_tokens, length, max_model_len)
        tokens += length + max(0, budget)
    return params.n * len(prompt_lengths), params.n * tokens


def check_request(tenant: Tenant, num_seqs: int, num_tokens: int) -> TenantCaps | None:
    """The caps a request of `num_seqs` sequences that may use `num_tokens` tokens carries to
    the engine (None: the tenant has none); TenantLimitExceeded (never retryable) when it
    exceeds a cap on its own."""
    caps = TenantCaps(tenant.max_concurrent_requests, tenant.tokens_per_minute)
    cap = caps.max_concurrent_requests
    if cap is not None and num_seqs > cap:
        raise TenantLimitExceeded(
            f"the request runs {num_seqs} sequences (n x prompts), more than tenant "
            f"{tenant.name!r} may run at once ({cap}); lower n or send fewer prompts",
            param="n",
        )
    tpm = caps.tokens_per_minute
    if tpm is not None and num_tokens > tpm:
        raise TenantLimitExceeded(
            f"the request may use {num_tokens} tokens (prompt plus max_tokens, per sequence), "
            f"more than the budget of tenant {tenant.name!r} ({tpm} tokens per minute); lower "
            "max_tokens or n, or send fewer prompts",
            param="max_tokens",
        )
    return caps if caps.capped else None


def reserve(
    caps: TenantCaps | None,
    engine: EngineClient,
    params: SamplingParams,
    prompt_length: int,
    continuation: bool = False,
) -> TenantReservation | None:
    """What one engine request (one prompt, n samples) on `engine` holds of `caps` while it
    runs (None: no caps to hold)."""
    if caps is None:
        return None
    num_seqs, num_tokens = reservation(
        engine.max_model_len, params, [prompt_length], engine.generation_defaults
    )
    return TenantReservation(caps, num_seqs, num_tokens, continuation)


def limit_error(error: TenantLimitExceeded) -> APIError:
    """429 with Retry-After while the caps are busy; 400 (naming the field) for a request that
    never fits."""
    if error.retry_after_s is None:
        return APIError(400, str(error), param=error.param, code="tenant_limit_exceeded")
    return APIError(
        429,
        str(error),
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(error.retry_after_s)},
    )
