"""Authentication and admission: an ASGI middleware in front of every route.

It maps `Authorization: Bearer <key>` to a `Caller` (401 in OpenAI's shape if the key is missing
or unknown) and keeps `/admin/` for the admin key (403 on a server that has none: the admin API
is off, so an open server cannot be taken over by whoever creates the first tenant). Generation
routes `admit` their request once they know how many sequences and tokens it needs: a request
over a cap on its own is a 400 here, and the caps it carries to the engine come back, which
counts them for the whole server (429 with Retry-After: `tenancy/limits.py`); the middleware
counts each generation request's status per tenant.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.api.dashboard.sessions import DashboardSessions
from loraplex.platform.api.errors import APIError
from loraplex.platform.api.tenancy.limits import check_request, limit_error
from loraplex.platform.api.tenancy.tenancy import Caller, Tenancy
from loraplex.platform.api.tenancy.tenant_store import Tenant
from loraplex.platform.core.errors import TenantLimitExceeded
from loraplex.platform.core.tenant_caps import TenantCaps

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/adapters/resident", "/openapi.json", "/docs"})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
DASHBOARD = "/dashboard"  # the page and its login check the key themselves (401: a login form)
_CALLER = "loraplex.caller"
ADMIN_DISABLED = (
    "The admin API is disabled: this server has no admin key. Start it with --admin-key "
    "(or the LORAPLEX_ADMIN_KEY environment variable) to manage tenants."
)


def admin_disabled() -> APIError:
    return APIError(403, ADMIN_DISABLED, type="permission_error", code="admin_disabled")


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


def admit(request: Request, num_seqs: int, num_tokens: int) -> TenantCaps | None:
    """The calling tenant's caps, which each engine request of this HTTP request carries (the
    engine holds them for the whole server); None for a caller without caps. 400 when the
    request alone exceeds a cap, which no wait would fix."""
    tenant = caller_of(request).tenant
    if tenant is None:
        return None
    try:
        return check_request(tenant, num_seqs, num_tokens)
    except TenantLimitExceeded as error:
        raise limit_error(error) from None


def _tenancy(request: Request) -> Tenancy:
    return request.app.state.loraplex.tenancy


def require_admin(request: Request) -> Caller:
    """The admin caller; 403 on a server without an admin key (its admin API is off, open or
    not), 401 for any other key."""
    if not _tenancy(request).tenants.has_admin:
        raise admin_disabled()
    caller = caller_of(request)
    if not caller.is_admin:
        raise unauthorized("this endpoint takes only the admin key")
    return caller


class AuthMiddleware:
    """Identify the caller of every HTTP request; admit generation requests under the caps."""

    def __init__(
        self, app: ASGIApp, tenancy: Tenancy, sessions: DashboardSessions | None = None
    ) -> None:
        self.app = app
        self.tenancy = tenancy
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or _dashboard(scope["path"]):
            await self.app(scope, receive, send)
            return
        admin_route = scope["path"].startswith("/admin/")
        if admin_route and not self.tenancy.tenants.has_admin:
            await _reply(admin_disabled(), scope, receive, send)
            return
        caller = self.tenancy.identify(_header(scope, b"authorization"))
        if caller is None and self.sessions is not None:
            cookie = _header(scope, b"cookie")
            if self.sessions.authenticates(scope["method"], scope["path"], cookie):
                caller = Caller(None, is_admin=True)
        if caller is None:
            await _reply(unauthorized("Missing or unknown API key."), scope, receive, send)
            return
        if admin_route and not caller.is_admin:
            await _reply(
                unauthorized("this endpoint takes only the admin key"), scope, receive, send
            )
            return
        scope[_CALLER] = caller
        generating = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        if not generating or caller.tenant is None:
            await self.app(scope, receive, send)
            return
        await self._serve_generation(caller.tenant, scope, receive, send)

    async def _serve_generation(
        self, tenant: Tenant, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Run a generation route; count it (by its status) once it ends."""
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.tenancy.metrics.count_request(tenant.name, status)


def _dashboard(path: str) -> bool:
    return path == DASHBOARD or path.startswith(DASHBOARD + "/")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _reply(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = error.response()
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    await response(scope, receive, send)
