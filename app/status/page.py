"""`GET /status` (one page: HTML, CSS and JavaScript shipped as package data, nothing from
elsewhere) and the routes its data comes by: `GET /admission/events`, and CORS preflights for
it and `/admission`.

The page itself holds no data, so it is served without a key; its data needs one when keys are
set (the page asks for it once and keeps it in the tab's sessionStorage, never in a URL). It is
served under a Content-Security-Policy that lets it run only its own script and style, and
never in a frame.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from slotgate.asgi import Header
from slotgate.errors import Unauthorized
from slotgate.gate.tenants import credentials, roster
from slotgate.proxy.access import Access
from slotgate.status.events import Events
from slotgate.upstreams.cors import CorsPolicy

#: The page's files, by the path each is served at.
FILES = {
    "/status": ("index.html", "text/html; charset=utf-8"),
    "/status/status.css": ("status.css", "text/css; charset=utf-8"),
    "/status/status.js": ("status.js", "text/javascript; charset=utf-8"),
}
#: Every path this module answers (the gateway sends them to FastAPI, not to llama-server).
PATHS = frozenset({*FILES, "/admission/events"})
#: Its own script, style and data, nothing inline, nothing from elsewhere, in no frame.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
_PREFLIGHT = [
    (b"access-control-allow-methods", b"GET, OPTIONS"),
    (b"access-control-allow-headers", b"authorization, x-api-key"),
    (b"access-control-max-age", b"600"),
]


def data_headers(cors: CorsPolicy, origin: str | None) -> list[Header]:
    """The headers of `/admission` and its stream: CORS as llama-server gives `origin`
    (app/upstreams/cors.py), and nosniff."""
    given = cors.headers_for(origin.encode("latin-1") if origin is not None else None)
    return [*given, (b"x-content-type-options", b"nosniff")]


Check = Callable[[Request], Coroutine[Any, Any, None]]


def watchers(access: Access, admin_keys: Iterable[str]) -> Check:
    """Who may read the page's data (`/admission` and its stream): with API_KEYS, a client's
    key; with ADMIN_KEYS, an admin key too (an operator sees what they steer), and with
    ADMIN_KEYS alone, only an admin key; with neither, anyone, as before."""
    admins = roster(admin_keys)

    async def check(request: Request) -> None:
        authorization = request.headers.get("authorization", "").encode("latin-1") or None
        # Bearer only, as for the controls: an X-Api-Key is a client's, never an operator's.
        if admins.keyed and admins.identify(credentials(authorization, None)) is not None:
            return
        if access.enabled:
            api_key = request.headers.get("x-api-key", "").encode("latin-1") or None
            access.check(request.url.path, authorization, api_key)
        elif admins.keyed:
            raise Unauthorized(
                "the status data needs a key: send Authorization: Bearer <admin key>"
            )

    return check


def install(
    app: FastAPI,
    events: Events,
    cors: Callable[[], CorsPolicy],
    authorized: Check,
) -> None:
    """Add the page, its files, the event stream and the preflights to `app`."""
    files = resources.files("slotgate.status") / "web"
    loaded = {
        path: (files.joinpath(name).read_bytes(), kind) for path, (name, kind) in FILES.items()
    }

    async def page(request: Request) -> Response:
        body, kind = loaded[request.url.path]
        return Response(body, media_type=kind, headers=PAGE_HEADERS)

    for path in FILES:
        app.add_api_route(path, page, methods=["GET", "HEAD"], include_in_schema=False)

    @app.get("/admission/events", dependencies=[Depends(authorized)])
    async def admission_events(request: Request) -> Response:
        """`/admission` as server-sent events, one a second while the client watches."""
        return events.stream(data_headers(cors(), request.headers.get("origin")))

    @app.options("/admission")
    @app.options("/admission/events")
    async def preflight(request: Request) -> Response:
        """A browser's preflight for a GET with a key: allowed where llama-server allows the
        Origin, never with credentials."""
        headers = data_headers(cors(), request.headers.get("origin"))
        if any(name == b"access-control-allow-origin" for name, _ in headers):
            headers += _PREFLIGHT
        answer = Response(status_code=204)
        answer.raw_headers.extend(headers)
        return answer
