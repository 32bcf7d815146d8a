"""Authentication and admission: an ASGI middleware in front of every route.

It maps `Authorization: Bearer <key>` to a `Caller` (401 in OpenAI's shape if the key is missing
or unknown) and keeps `/admin/` for the admin key (403 on a server that has none: the admin API
is off, so an open server cannot be taken over by whoever creates the first tenant). Generation
routes `admit` their request against the tenant's caps once they know how many sequences and
tokens it needs (429 with Retry-After); the middleware releases that reservation when the
response — streamed or not — ends.
"""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.api.dashboard.sessions import DashboardSessions
from loraplex.platform.api.errors import APIError
from loraplex.platform.api.tenancy.limits import Reservation
from loraplex.platform.api.tenancy.tenancy import Caller, Tenancy
from loraplex.platform.api.tenancy.tenant_store import Tenant

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/adapters/resident", "/openapi.json", "/docs"})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
DASHBOARD = "/dashboard"  # the page and its login check the key themselves (401: a login form)
_CALLER = "loraplex.caller"
_RESERVATIONS = "loraplex.reservations"
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


def admit(request: Request, num_seqs: int, num_tokens: int) -> None:
    """Hold `num_seqs` sequences and `num_tokens` tokens of the calling tenant's caps until the
    response ends. 429 (with Retry-After) when the caps are busy; 400 when the request alone
    exceeds a cap, which no wait would fix."""
    caller = caller_of(request)
    held: list[Reservation] | None = request.scope.get(_RESERVATIONS)
    if caller.tenant is None or held is None:
        return
    result = _tenancy(request).limiter.try_admit(caller.tenant, num_seqs, num_tokens)
    if isinstance(result, Reservation):
        held.append(result)
        return
    if result.retry_after_s is None:
        raise APIError(400, result.message, param=result.param, code="tenant_limit_exceeded")
    raise APIError(
        429,
        result.message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(result.retry_after_s)},
    )


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
        """Run a generation route; release what it `admit`ted and count it once it ends."""
        held: list[Reservation] = []
        scope[_RESERVATIONS] = held
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            for reservation in held:
                self.tenancy.limiter.release(reservation)
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
