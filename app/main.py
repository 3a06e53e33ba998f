"""The app factory: slotgate's own routes on FastAPI, every other path through the gate."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from slotgate.asgi import Message, Receive, Scope, Send
from slotgate.controls import PREFIX, Operators
from slotgate.errors import BadRequest, GateError, refusal, route_refusal
from slotgate.gate.admission import Admission
from slotgate.gate.entry import Gate, Local
from slotgate.gate.models import Models
from slotgate.gate.pool import Snapshot
from slotgate.gate.quotas import Ledger, Windows
from slotgate.gate.tenants import Tenant
from slotgate.metrics import Metrics
from slotgate.proxy.access import Access
from slotgate.proxy.front import Front
from slotgate.proxy.headers import id_headers
from slotgate.proxy.refusals import render
from slotgate.proxy.relay import Proxy
from slotgate.proxy.request import request_id
from slotgate.settings import Settings
from slotgate.status import page
from slotgate.status.events import Events
from slotgate.status.recent import Recent
from slotgate.status.waiting import waiting
from slotgate.upstreams.fleet import Fleet, Resolver
from slotgate.upstreams.upstream import Upstream
from starlette.exceptions import HTTPException

log = logging.getLogger("slotgate")

#: The paths slotgate answers itself; everything else belongs to llama-server.
OWN_PATHS = frozenset({"/admission", "/metrics", "/healthz", "/readyz", *page.PATHS})
#: What `GET /metrics?source=...` serves: both, slotgate's own series (which promtool passes),
#: or llama-server's `llamacpp:*` alone (which promtool fails on their names).
METRICS_SOURCES = ("all", "slotgate", "llama-server")


class Gateway(FastAPI):
    """FastAPI for slotgate's own routes; proxied traffic skips its middleware entirely.

    A relayed request never needs FastAPI's routing, dependency solving or error middleware,
    and every SSE chunk would otherwise cross each of those wrappers on its way out. slotgate's
    server calls `front` (app/proxy/front.py), which sends such a request to the proxy without
    this class's interpreted coroutine; another server calling this app gets the same split.
    """

    proxy: Proxy
    front: Front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if self.front.relays(scope["path"]):
            # Read, then called: called as a method, an attribute the instance holds is a
            # lookup Python 3.11 cannot specialize.
            proxy = self.proxy
            await proxy(scope, receive, send)
            return
        # slotgate's own answers carry the request id as relayed ones do, errors included.
        ids = id_headers(request_id(scope))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *ids]
            await send(message)

        await super().__call__(scope, receive, send_with_id)


class Service:
    """The pieces one app owns (admission, upstreams, metrics, proxy), built and closed together."""

    def __init__(self, settings: Settings, resolver: Resolver | None = None) -> None:
        self.settings = settings
        self.admission = Admission(
            settings.queue_policy,
            queue_timeout_s=settings.queue_timeout_s,
            startup_wait_s=settings.startup_wait_s,
            epsilon=settings.routing_epsilon,
        )
        self.access = Access(settings.api_keys, settings.api_keys_file)
        #: One line per model, once an upstream turns out to be a llama-server router.
        self.models = Models(self._model_admission)
        self.fleet = Fleet(settings, self.admission, resolver, self.models)
        #: The way into admission: the core's own, or the line shared with other replicas
        #: through Redis (REDIS_URL; without it no Redis code is even imported).
        self.gate: Gate = Local(self.admission)
        #: The tenants' quota windows, kept apart from the roster so that a reload keeps them:
        #: this process's (`quotas`), or the fleet's in Redis (REDIS_URL), counted here only
        #: while Redis is away.
        self.quotas = Windows()
        self.ledger: Ledger = self.quotas
        if settings.redis_url is not None and settings.admission_control:
            from slotgate.replicas.replica import (
                ReplicaAdmission,  # only with REDIS_URL: no Redis code else
            )

            replica = ReplicaAdmission(settings, self.admission, settings.redis_url)
            # A KV budget another replica learned: this one's upstream learns it too.
            replica.learn = lambda pool: self.fleet.of(pool).learn_shared_cache(
                f"another replica saw llama-server at {pool.key} run out of KV cache"
            )
            self.gate = replica
            from slotgate.replicas.quotas import SharedWindows

            self.ledger = SharedWindows(
                settings.redis_url, settings.redis_fleet, timeout_s=settings.redis_timeout_s,
                local=self.quotas,
            )  # fmt: skip
        self.metrics = Metrics(
            self.admission,
            lambda: self.fleet.ready,
            by_tenant=self.access.enabled,
            tenants=settings.metrics_tenants,
            gate=self.gate,
            models=self.models,
        )
        # A reload (SIGHUP) reaches the line: weights and limits from then on.
        self.access.tenants.listeners.append(lambda roster: self.gate.retune(roster.tenants))
        self.access.tenants.listeners.append(lambda roster: self.models.retune(roster.tenants))
        self.proxy = Proxy(
            settings, self.admission, self.fleet, self.metrics, self.access, self.gate,
            self.ledger,
        )  # fmt: skip
        self.operators = Operators(
            settings.admin_keys,
            self.access,
            self.gate,
            self.fleet,
            self.proxy.running,
            self.metrics,
        )
        self.draining = False
        #: The status page's figures of the last minutes, and its stream's watchers.
        self.recent = Recent()
        self.events = Events(
            lambda: json.dumps(self.snapshot(), separators=(",", ":")).encode(),
            settings.status_watchers,
        )

    def _model_admission(self) -> Admission:
        """A model's own admission core: the settings of the one line, for its line."""
        settings = self.settings
        return Admission(
            settings.queue_policy,
            queue_timeout_s=settings.queue_timeout_s,
            startup_wait_s=settings.startup_wait_s,
            epsilon=settings.routing_epsilon,
        )

    def drain(self) -> None:
        """Shutdown has begun: refuse new work and turn the queue away; streams run on."""
        if not self.draining:
            log.info("draining: no new requests; running streams may finish")
        self.draining = True
        self.gate.drain()
        self.models.close()
        self.events.close()

    @property
    def upstream(self) -> Upstream:
        """The first upstream (the only one, unless several are configured or discovered)."""
        return self.fleet.upstreams[0]

    def snapshot(self) -> dict[str, Any]:
        snap = self.admission.snapshot()
        now = time.monotonic()
        self.recent.read(self.metrics.totals(), now)
        primary = self.fleet.primary
        props = primary.props
        models = self.fleet.models()
        return {
            **_figures(snap),
            "admission_control": self.settings.admission_control,
            # An operator paused admission (POST /admin/pause): new requests wait in line.
            "paused": self.gate.paused,
            "retry_after_estimate_s": round(self.admission.estimate_s(), 3),
            "upstream": {
                "url": primary.url,
                "ready": self.fleet.ready,
                "reason": "ready" if self.fleet.ready else self.fleet.reason,
                "keeps_connections_after_streams": primary.keeps_streams,
                "n_ctx": props.n_ctx if props else None,
                "model": props.model if props else None,
                "build_info": props.build_info if props else None,
            },
            "routing": self.settings.routing,
            # Upstreams are meant to serve one model; say when their /props disagree.
            "models_differ": len(models) > 1,
            "upstreams": [
                {
                    "name": upstream.name,
                    "url": upstream.url,
                    "ready": upstream.ready,
                    # Drained by an operator: its running requests finish, nothing new goes
                    # there, and its slots are not counted in `capacity`.
                    "draining": upstream.draining,
                    # A llama-server router: its slots are its models' (under "models").
                    "router": upstream.router is not None,
                    "reason": upstream.reason,
                    "capacity": upstream.pool.capacity,
                    "active": upstream.pool.active,
                    "committed_tokens": upstream.pool.committed,
                    "budget_tokens": upstream.pool.budget,
                    "model": upstream.props.model if upstream.props else None,
                    "n_ctx": upstream.props.n_ctx if upstream.props else None,
                    "routed": dict(upstream.pool.routed),
                }
                for upstream in self.fleet
            ],
            "tenants": self.tenants(),
            "replication": self.gate.view(),
            **({"models": self.models_view()} if self.models.routed else {}),
            # Read from the proxy's waiters and the metrics' counts now, not kept per request.
            "waiting": waiting(self.proxy.running.watches(), self.admission.eta_s),
            "recent": self.recent.view(now),
            # PREEMPT_AFTER_S: requests preempted before their first byte so far.
            "preemptions": None if (p := self.proxy.preemption) is None else p.count,
        }

    def models_view(self) -> list[dict[str, Any]]:
        """Each model a router serves: its state, its line and its pools."""
        shown = []
        for lane in self.models:
            snap = lane.admission.snapshot()
            shown.append(
                {
                    "model": lane.model,
                    "aliases": sorted(lane.aliases),
                    "state": lane.state,
                    "states": dict(lane.states),
                    **({"exit_codes": dict(lane.exit_codes)} if lane.exit_codes else {}),
                    "autoload": lane.autoload,
                    "held": lane.held,
                    **_figures(snap),
                    "retry_after_estimate_s": round(lane.admission.estimate_s(), 3),
                    "pools": [
                        {
                            "key": pool.key,
                            "model": lane.model,
                            "capacity": pool.capacity,
                            "active": pool.active,
                            # Its upstream drained by an operator (a router: all its models).
                            "draining": pool.draining,
                            "budget_tokens": pool.budget,
                            "committed_tokens": pool.committed,
                        }
                        for pool in lane.admission.pools
                    ],
                }
            )
        return shown

    def tenants(self) -> list[dict[str, Any]]:
        """Each tenant by name (never a key), its share and what it holds and waits for."""
        shown = []
        shares = self.metrics.minute.shares(time.monotonic())
        for tenant in self.access.tenants.roster.tenants:
            active, queued = self.admission.tenant_counts(tenant.name)
            shown.append(
                {
                    "name": tenant.name,
                    "band": tenant.band,
                    "weight": tenant.weight,
                    "max_active": tenant.max_active,
                    "max_queued": tenant.max_queued,
                    "active": active,
                    "queued": queued,
                    # Its part of the slot-seconds held by requests that ended in about the
                    # last minute (0 to 1; all tenants' add up to 1 once anything ended).
                    "slot_seconds_share_1m": round(shares.get(tenant.name, 0.0), 4),
                    **({} if tenant.quota is None else {"quota": self.quota_view(tenant)}),
                }
            )
        return shown

    def quota_view(self, tenant: Tenant) -> dict[str, dict[str, Any]]:
        """A tenant's standing against each of its limits, read now from its windows (one
        window per tenant, whatever the model). With REDIS_URL the fleet's windows are in
        Redis, which /admission does not wait for: the limits alone are shown."""
        quota = tenant.quota
        assert quota is not None  # noqa: S101 - only tenants with a quota are shown one
        shown: dict[str, dict[str, Any]] = self.quotas.view(tenant.name, quota)
        if self.ledger is not self.quotas:
            for window in shown.values():
                window.update(used=None, remaining=None, reset_s=None)
        return shown


def _figures(snap: Snapshot) -> dict[str, Any]:
    """A line's figures as `/admission` shows them."""
    return {
        "capacity": snap.capacity,
        "active": snap.active,
        "queued": snap.queued,
        "free": snap.free,
        "queue_limit": snap.queue_limit,
        "budget_tokens": snap.budget_tokens,
        "committed_tokens": snap.committed_tokens,
        "free_tokens": snap.free_tokens,
    }


def create_app(settings: Settings | None = None, resolver: Resolver | None = None) -> Gateway:
    """Build one slotgate app; its lifespan starts and stops the upstreams' clients.
    `resolver` resolves upstream host names (the system's, unless a test gives another)."""
    settings = settings or Settings()
    service = Service(settings, resolver)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        service.access.tenants.install(loop)  # API_KEYS_FILE is read again on SIGHUP
        async with contextlib.AsyncExitStack() as scope:
            # Before the followers, whose first capacities reach a shared line as they come;
            # closed after the requests have ended: what Redis still counts here goes back then.
            await service.gate.start()
            scope.push_async_callback(service.gate.close)
            scope.push_async_callback(service.ledger.aclose)
            await service.fleet.start()
            scope.push_async_callback(service.fleet.close)
            try:
                yield
            finally:
                service.access.tenants.uninstall(loop)
                service.drain()

    app = Gateway(
        title="slotgate",
        summary="Admission gate in front of llama.cpp's llama-server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    app.proxy = service.proxy
    app.front = Front(service.proxy, app, OWN_PATHS, PREFIX)
    app.state.service = service

    async def authorized(request: Request) -> None:
        service.access.check(
            request.url.path,
            request.headers.get("authorization", "").encode("latin-1") or None,
            request.headers.get("x-api-key", "").encode("latin-1") or None,
        )

    @app.exception_handler(GateError)
    async def gate_error(request: Request, exc: GateError) -> Response:
        status, headers, body = render(refusal(exc), "openai")
        return Response(body, status, {k.decode(): v.decode() for k, v in headers})

    @app.exception_handler(HTTPException)
    async def route_error(request: Request, exc: HTTPException) -> Response:
        # e.g. POST /healthz: the API's error shape, not the framework's {"detail": ...}
        status, headers, body = render(route_refusal(exc.status_code, str(exc.detail)), "openai")
        answer = Response(body, status, {k.decode(): v.decode() for k, v in headers})
        answer.headers.update(exc.headers or {})  # Allow, on a 405
        return answer

    # HEAD too: some load balancers probe with it.
    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz() -> dict[str, str]:
        """slotgate itself is alive (says nothing of llama-server)."""
        return {"status": "ok"}

    @app.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz() -> JSONResponse:
        """200 when llama-server answers and its slot count is known; 503 with the reason."""
        if service.draining:
            return JSONResponse({"status": "draining"}, 503, {"retry-after": "1"})
        if not service.fleet.ready:
            return JSONResponse(
                {"status": "not ready", "reason": service.fleet.reason},
                503,
                {"retry-after": "1"},
            )
        if all(u.draining for u in service.fleet if u.ready):
            # Ready while another upstream serves; with every ready one drained, nothing does.
            return JSONResponse(
                {"status": "not ready", "reason": "every ready upstream is drained"},
                503,
                {"retry-after": "1"},
            )
        gate = service.gate
        mode = gate.mode
        # A shared line says how it is kept: degraded (Redis away) is still ready.
        said: dict[str, Any] = {} if mode == "local" else {"replication": mode}
        reason = gate.unready()
        if reason is not None:
            return JSONResponse(
                {"status": "not ready", "reason": reason, **said}, 503, {"retry-after": "1"}
            )
        models = service.models
        if models.routed:
            # Ready while the routers answer, whatever their models' states (in /admission).
            loaded = sum(lane.running for lane in models)
            said["models"] = {"listed": len(models), "loaded": loaded}
        return JSONResponse({"status": "ready", "capacity": service.admission.capacity, **said})

    # The page's data: a client's key, or an operator's (app/status/page.py).
    watching = page.watchers(service.access, settings.admin_keys)

    @app.get("/admission", dependencies=[Depends(watching)])
    async def admission(request: Request) -> Response:
        """Admission now: capacity, active, queued, free, queue_limit and the upstream."""
        answer = JSONResponse(service.snapshot())
        answer.raw_headers.extend(
            page.data_headers(service.fleet.primary.cors, request.headers.get("origin"))
        )
        return answer

    page.install(app, service.events, lambda: service.fleet.primary.cors, watching)

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics(source: str = "all") -> Response:
        """slotgate's metrics, then llama-server's own when it runs with --metrics;
        `?source=slotgate` or `?source=llama-server` for one of them alone."""
        if source not in METRICS_SOURCES:
            raise BadRequest(
                f"source={source!r} is not one of {', '.join(METRICS_SOURCES)}", param="source"
            )
        text = service.metrics.render() if source != "llama-server" else b""
        headers: dict[str, str] = {}
        if source != "slotgate":
            theirs, kept = await service.fleet.metrics()
            text += theirs
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in kept}
        return Response(
            text, media_type="text/plain; version=0.0.4; charset=utf-8", headers=headers
        )

    # -- operator controls (app/controls.py) ----------------------------------------------------

    operators = service.operators

    def operator(request: Request) -> str:
        client = request.client.host if request.client is not None else None
        headers = request.headers
        return operators.who(
            client, headers.get("authorization", "").encode("latin-1") or None, headers
        )

    def upstream_named(name: str) -> Upstream:
        upstream = operators.upstream(name)
        if upstream is None:
            names = ", ".join(u.name for u in service.fleet)
            raise HTTPException(404, f"no upstream is named {name!r}; upstreams: {names}")
        return upstream

    @app.post(PREFIX + "upstreams/{name:path}/drain")
    async def drain(name: str, who: str = Depends(operator)) -> dict[str, Any]:
        """Take one upstream out of rotation: its running requests finish, nothing new goes
        there."""
        upstream = upstream_named(name)
        operators.drain(who, upstream)
        return {"ok": True, "upstream": upstream.name, "draining": True}

    @app.post(PREFIX + "upstreams/{name:path}/restore")
    async def restore(name: str, who: str = Depends(operator)) -> dict[str, Any]:
        """Put a drained upstream back in rotation."""
        upstream = upstream_named(name)
        operators.restore(who, upstream)
        return {"ok": True, "upstream": upstream.name, "draining": False}

    @app.post(PREFIX + "pause")
    async def pause(who: str = Depends(operator)) -> dict[str, Any]:
        """Hold admission: new requests wait in line (its limit and timeout apply), running
        ones finish."""
        operators.pause(who)
        return {"ok": True, "paused": True}

    @app.post(PREFIX + "resume")
    async def resume(who: str = Depends(operator)) -> dict[str, Any]:
        operators.resume(who)
        return {"ok": True, "paused": False}

    @app.post(PREFIX + "requests/{request_id}/cancel")
    async def cancel(request_id: str, who: str = Depends(operator)) -> dict[str, Any]:
        """End one request by its id (X-Request-Id): out of the line, or its generation cut."""
        if not operators.cancel(who, request_id):
            raise HTTPException(404, f"no request {request_id!r} is waiting or running")
        return {"ok": True, "request_id": request_id, "cancelled": True}

    return app
