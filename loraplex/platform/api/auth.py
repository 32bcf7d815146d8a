"""Authentication and admission: an ASGI middleware in front of every route.

It maps `Authorization: Bearer <key>` to a `Caller` (401 in OpenAI's shape if the key is missing
or unknown), keeps `/admin/` for the admin key, and holds each generation request to its
tenant's caps (429 with Retry-After) for as long as its response — streamed or not — runs.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.api.errors import APIError
from loraplex.platform.api.tenancy import Caller, Tenancy
from loraplex.platform.api.tenants import Tenant

PUBLIC_PATHS = frozenset({"/health", "/metrics"})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_CALLER = "loraplex.caller"


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key")


def caller_of(request: Request) -> Caller:
    """The request's caller, as the middleware identified it."""
    return request.scope[_CALLER]


def tenant_of(request: Request) -> Tenant:
    """The calling tenant; 401 for the admin key on a tenant's endpoint."""
    caller = caller_of(request)
    if caller.tenant is None:
        raise unauthorized("this endpoint takes a tenant's API key, not the admin key")
    return caller.tenant


def require_admin(request: Request) -> Caller:
    caller = caller_of(request)
    if not caller.is_admin:
        raise unauthorized("this endpoint takes only the admin key")
    return caller


class AuthMiddleware:
    """Identify the caller of every HTTP request; admit generation requests under the caps."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy) -> None:
        self.app = app
        self.tenancy = tenancy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        caller = self.tenancy.identify(_header(scope, b"authorization"))
        if caller is None:
            await _reply(unauthorized("Missing or unknown API key."), scope, receive, send)
            return
        if scope["path"].startswith("/admin/") and not caller.is_admin:
            await _reply(
                unauthorized("this endpoint takes only the admin key"), scope, receive, send
            )
            return
        scope[_CALLER] = caller
        generating = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        if not generating or caller.tenant is None:
            await self.app(scope, receive, send)
            return
        await self._admit(caller.tenant, scope, receive, send)

    async def _admit(self, tenant: Tenant, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.tenancy.metrics
        refused = self.tenancy.limiter.try_admit(tenant)
        if refused is not None:
            metrics.count_request(tenant.name, 429)
            error = APIError(
                429, refused.message, type="rate_limit_error", code="rate_limit_exceeded"
            )
            headers = {"Retry-After": str(refused.retry_after_s)}
            await _reply(error, scope, receive, send, headers)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.tenancy.limiter.release(tenant.name)
            metrics.count_request(tenant.name, status)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _reply(
    error: APIError,
    scope: Scope,
    receive: Receive,
    send: Send,
    headers: dict[str, Any] | None = None,
) -> None:
    response = error.response()
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    for key, value in (headers or {}).items():
        response.headers[key] = value
    await response(scope, receive, send)
