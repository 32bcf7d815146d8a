"""The operator dashboard: `GET /dashboard` (one page, plain HTML and a small script, no build
step), its login, and `GET /admin/stats` (the JSON the page reads every second or two).

Both take the admin key: in `Authorization: Bearer <key>` as every admin route does, or, for a
browser, through the login form, which trades the key for a session cookie (see
`DashboardSessions`). Without either the page answers 401 with the login form, and the JSON 401
in OpenAI's error shape; on a server without an admin key both answer 403.
"""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from loraplex.platform.api.dashboard.sessions import COOKIE, DashboardSessions, cookie_value
from loraplex.platform.api.dashboard.stats import StatsCollector
from loraplex.platform.api.errors import APIError
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenancy.auth import ADMIN_DISABLED

router = APIRouter()

STATIC_DIR = Path(__file__).parent / "static"
#: the page's assets, by URL name -> media type (nothing else under STATIC_DIR is served)
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
MAX_LOGIN_BODY_BYTES = 4096
MAX_LOGIN_FIELDS = 4
# NOTE: the page runs only its own script and style; no frame may embed it.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class Dashboard:
    """The dashboard's state in one server: its sessions and the stats sampler."""

    def __init__(self, state: ServerState, admin_key: str | None) -> None:
        # NOTE: beside the tenants, so every API process (and replica) sharing them shares the
        # sessions, and a logout ends a session everywhere.
        self.sessions = DashboardSessions(admin_key, state.tenancy.registry.root)
        self.stats = StatsCollector(state)


def dashboard_of(request: Request) -> Dashboard:
    return request.app.state.dashboard


def _page(name: str, status: int, message: str = "") -> HTMLResponse:
    text = (STATIC_DIR / name).read_text(encoding="utf-8")
    text = text.replace("{{message}}", html.escape(message))
    return HTMLResponse(text, status_code=status, headers=SECURITY_HEADERS)


def _is_admin(request: Request, dashboard: Dashboard) -> bool:
    """The admin key in the Authorization header, or a valid session cookie."""
    state = server_state(request)
    caller = state.tenancy.identify(request.headers.get("authorization"))
    if caller is not None and caller.is_admin:
        return True
    return dashboard.sessions.is_valid(cookie_value(request.headers.get("cookie", ""), COOKIE))


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page(request: Request) -> Response:
    """The page for the admin; the login form (401) for anyone else."""
    dashboard = dashboard_of(request)
    if not server_state(request).tenancy.tenants.has_admin:
        return _page("login.html", 403, ADMIN_DISABLED)
    if not _is_admin(request, dashboard):
        return _page("login.html", 401)
    return _page("index.html", 200)


@router.post("/dashboard/login", include_in_schema=False)
async def dashboard_login(request: Request) -> Response:
    """A form post of `key`: the admin key sets the session cookie and goes to the page."""
    dashboard = dashboard_of(request)
    tenants = server_state(request).tenancy.tenants
    if not tenants.has_admin:
        return _page("login.html", 403, ADMIN_DISABLED)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_LOGIN_BODY_BYTES:
            return _page("login.html", 413, "The login form was too large.")
    try:
        form = parse_qs(body.decode("utf-8", "replace"), max_num_fields=MAX_LOGIN_FIELDS)
    except ValueError:  # more fields than that
        return _page("login.html", 400, "The login form holds too many fields.")
    key = (form.get("key") or [""])[0].strip()
    if not key or not tenants.is_admin_key(key):
        return _page("login.html", 401, "That is not the admin key.")
    response = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
    response.set_cookie(
        COOKIE,
        dashboard.sessions.issue(),
        max_age=dashboard.sessions.ttl_s,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/dashboard/logout", include_in_schema=False)
async def dashboard_logout(request: Request) -> Response:
    """End the session of the request's cookie (in every API process) and drop the cookie."""
    token = cookie_value(request.headers.get("cookie", ""), COOKIE)
    dashboard_of(request).sessions.revoke(token)
    response = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def dashboard_asset(name: str) -> Response:
    """The page's script and style sheet (public: they hold no data)."""
    media_type = ASSETS.get(name)
    if media_type is None:
        raise APIError(404, f"No dashboard asset `{name}`.", type="not_found_error")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers=SECURITY_HEADERS)


@router.get("/admin/stats")
async def admin_stats(request: Request) -> JSONResponse:
    """Tenants, adapters and the engine, as the dashboard shows them (admin key or session)."""
    document = await dashboard_of(request).stats.collect()
    return JSONResponse(document, headers={"Cache-Control": "no-store"})
