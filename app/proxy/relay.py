"""The hot path: a plain ASGI app that gates every request slotgate does not own and relays
llama-server's answer as it comes. `Proxy` orchestrates one request: intake, admission, the
wait, the forward. What it hands off: a request is a `Request` (app/proxy/request.py), its
answer an `Answer` (app/proxy/answer.py); which headers cross is app/proxy/headers.py; the
relay modes are app/proxy/modes.py; a client leaving or a shutdown is app/proxy/watch.py; the
body bytes waiting requests hold are app/proxy/body_bytes.py; what a request leaves behind
(metrics, access log) is app/proxy/accounting.py.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable
from time import monotonic
from urllib.parse import parse_qs, quote

from slotgate.asgi import Headers, Receive, Scope, Send
from slotgate.errors import (
    AdmissionError,
    ClientGone,
    DeadlineUnmet,
    GateError,
    ModelNotLoaded,
    QuotaExceeded,
    UnknownModel,
    UpstreamFailed,
    UpstreamStarting,
    UpstreamUnavailable,
    refusal,
)
from slotgate.gate import deadlines
from slotgate.gate.admission import Admission
from slotgate.gate.entry import Entry, Gate, Local
from slotgate.gate.models import Lane, Models
from slotgate.gate.preemption import Preemption
from slotgate.gate.quotas import Ledger, Windows
from slotgate.gate.sessions import Sessions, routing_key, session_of
from slotgate.gate.ticket import Claim
from slotgate.intake.body import Reading, Wants, model_off_loop, take_off_loop
from slotgate.intake.endpoints import Kind, check_content_type, form_field, route_of
from slotgate.metrics import Metrics
from slotgate.outcome import Outcome
from slotgate.proxy.access import OPEN_PATHS, Access
from slotgate.proxy.accounting import account
from slotgate.proxy.answer import Answer
from slotgate.proxy.assembly import Assembly
from slotgate.proxy.body_bytes import BodyBytes, HeldBody
from slotgate.proxy.headers import SSE, SSE_HEAD, dropped, own_headers, upstream_headers
from slotgate.proxy.modes import (
    refuse,
    relay,
    relay_assembled,
    relay_into_stream,
    upstream_done,
)
from slotgate.proxy.quota import admit, headers_of
from slotgate.proxy.request import (
    Head,
    Request,
    checked_path,
    preflight_body,
    read_body,
)
from slotgate.proxy.watch import Running, Watch
from slotgate.settings import Settings
from slotgate.upstreams.client import Response
from slotgate.upstreams.fleet import Fleet

#: Stands for the unknown slot count while a request is checked before llama-server is up.
_UNSIZED = sys.maxsize
#: How long a preempted request may wait for its next slot while no upstream is known (its
#: wait is otherwise that of the line's head: the queue timeout does not apply again).
_PREEMPTED_WAIT_S = 3600.0
#: What the gate wants from a body when no budget binds, the gate is warm and nothing is
#: routed by key: its demand alone (one shared object, not one per request).
_NOTHING_MORE = Wants()
#: A named tuple made from all its fields at once, in C: the one a `NamedTuple` class makes
#: when called is a Python function (a call per request, for each of the two made here).
_made = tuple.__new__


def _lane(models: Models, request: Request, name: str | None, waits: bool) -> Lane:
    """The line of the model a request names (`name`, its body's `model`), or the router's
    refusal: an unknown model at once, as the router would; an unloaded one when the request
    or the router says not to load it (`?autoload=false`, --no-models-autoload). `waits`: a
    request may wait for its model to load (STARTUP_WAIT_S)."""
    lane = models.find(name) if name is not None else None
    if lane is None or not lane.states:  # never listed, or no longer listed anywhere
        if name is None:
            raise UnknownModel("")
        raise UnknownModel(name, models.limit if models.past(name) else None)
    autoload = lane.autoload
    if b"autoload=" in request.query:
        said = parse_qs(request.query.decode("latin-1")).get("autoload")
        if said:
            autoload = said[-1] in ("true", "1")
    if not lane.running:
        if not autoload:
            raise ModelNotLoaded
        if not (lane.autoload and waits):
            # Loaded at the next look, as the router would for this request: against the
            # router's default (?autoload=true), or though the request itself does not wait
            # for it (STARTUP_WAIT_S=0: it is told to retry). A waiter is reason enough else.
            lane.wanted = True
    return lane


def _eta_s(admission: Admission, lane: Lane | None, ticket: Claim) -> float:
    """When a waiter's slot should come, as its deadline reckons: its own line's estimate for
    its place, and for a model not running, what is left of its load (app/gate/models.py)."""
    eta_s = admission.eta_s(max(ticket.position, 1))
    if lane is not None:
        eta_s += lane.load_eta_s(monotonic())
    return eta_s


@functools.lru_cache(maxsize=256)
def _quoted(path: str) -> str:
    """The path as it goes upstream. A handful of paths carry nearly every request: quoting
    each one once saves a request a few microseconds; the cache's bound keeps made-up paths
    from growing it."""
    return quote(path, safe="/:@!$&'()*+,;=-._~")


class Proxy:
    """Gate and forward one request to llama-server."""

    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        fleet: Fleet,
        metrics: Metrics,
        access: Access | None = None,
        gate: Gate | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self._admission = admission
        #: The tenants' quota windows (app/gate/quotas.py): this process's, or the fleet's.
        self._ledger: Ledger = ledger or Windows()
        #: The way in: the core's own, or the fleet's line shared through Redis (REDIS_URL).
        self._gate: Gate = gate or Local(admission)
        self._fleet = fleet
        #: The lines of several models (app/gate/models.py), read once `routed`.
        self._models = fleet.lanes if fleet.lanes is not None else Models(Admission)
        # Affinity keys are read only when there is something to choose between.
        self._affinity = settings.routing == "affinity"
        #: Agent sessions' flows in the fair order (SESSION_FLOWS; None: off).
        self._sessions = Sessions(settings.session_flows) if settings.session_flows else None
        #: Preemption before the first byte (PREEMPT_AFTER_S; None: off).
        self.preemption = Preemption(settings.preempt_after_s) if settings.preempt_after_s else None
        self._metrics = metrics
        self._access = access or Access(settings.api_keys, settings.api_keys_file)
        self._gated = settings.admission_control
        self._body_limit = settings.max_body_bytes
        #: Bytes of gated bodies not yet admitted, bounded by QUEUE_BODY_BYTES.
        self.body_bytes = BodyBytes(settings.queue_body_bytes, admission)
        self._keepalive_s = settings.keepalive_interval_s
        self._head_after_s = settings.stream_head_after_s
        self._startup_wait_s = settings.startup_wait_s
        self._assemble = settings.stream_upstream
        self._drop = dropped(
            keep_conversation_id=settings.forward_conversation_id,
            # Whoever checks or supplies credentials keeps the client's to itself.
            keep_credentials=not self._access.enabled and settings.llama_api_key is None,
        )
        self._auth = fleet.primary.auth
        # Bound once: the relay modes and the watch take it for every request.
        self._own: Callable[[Request], Headers] = self._own_headers
        #: The requests under way, by request id: those an operator may cancel, and those
        #: waiting for slots (/admission's `waiting`).
        self.running = Running()

    # -- one request, top to bottom ------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # One coroutine, not one that makes the request and one that serves it: every frame a
        # waiting request is suspended in costs it about 270 bytes.
        if scope["type"] != "http":
            return
        held = HeldBody(self.body_bytes)
        request = Request(scope, held)
        answer = Answer(send)
        try:
            # Its body counts from its first byte until it is admitted (an early release) or
            # this block ends, whichever way it ends: a `finally`, not `with held:`, as a
            # `with` keeps a bound `__exit__` (64 bytes) on the frame of every waiting request.
            try:
                try:
                    await self._take_in(request, receive)
                    if not request.gated:
                        await self._pass(request, receive, answer)
                        return
                    if request.tenant.quota is not None:
                        await self._count(request, answer)
                    ticket = await self._enter(request)
                except (GateError, AdmissionError) as exc:
                    held.release()  # before its answer goes out, however slowly
                    await refuse(request, answer, refusal(exc), self._own)
                    return
                except ClientGone:
                    request.outcome = Outcome.CLIENT_GONE
                    return
                # The one place its slot (or its place in the queue) is given back, whatever
                # happens: what `async with ticket` does, without its two coroutines.
                try:
                    await self._gated_exchange(request, receive, answer, ticket)
                finally:
                    ticket.release()
            finally:
                if held.bytes:  # given back already, nearly always: no call for nothing
                    held.release()
        finally:
            account(request, answer, self._metrics)

    async def _take_in(self, request: Request, receive: Receive) -> None:
        """Check the path and the head, and read the body."""
        path = checked_path(request.path)
        # Known first, so that every refusal below is counted under the route and spoken in
        # the route's own error shape.
        request.endpoint = route_of(request.method, path)
        request.gated = self._gated and request.endpoint is not None
        head = request.head = Head(request.headers)
        request.origin = head.origin
        if request.method == "OPTIONS" and self._access.enabled:
            # A browser's CORS preflight carries no key, and no body: llama-server answers
            # it without a key and it starts nothing; so it passes, bodiless, unchecked.
            request.body = await preflight_body(receive, head.content_length)
        else:
            request.tenant = self._access.check(path, head.authorization, head.api_key)
            count = request.held.count if request.gated else None
            request.body = await read_body(receive, head.content_length, self._body_limit, count)

    async def _pass(self, request: Request, receive: Receive, answer: Answer) -> None:
        """Forward a request that takes no slot. A generation with ADMISSION_CONTROL off still
        closes its upstream connection when its client leaves, so llama-server stops working
        for nobody."""
        if request.endpoint is None:
            await self._forward(request, answer)
            return
        watch = Watch(receive, request, answer, self._own, self.running)
        try:
            await self._forward(request, answer)
        except BaseException as exc:
            if not await watch.settle(exc):
                raise
        finally:
            watch.close()

    async def _count(self, request: Request, answer: Answer) -> None:
        """Count it against its tenant's quota (or refuse it); its answer shows the standing."""
        try:
            answer.extra, answer.tally = await admit(self._ledger, request.tenant)
        except QuotaExceeded as exc:
            answer.extra = headers_of(exc.standing)
            raise

    async def _enter(self, request: Request) -> Claim:
        """Read the body's demand and join the queue (or take a slot at once)."""
        endpoint = request.endpoint
        head = request.head
        assert endpoint is not None  # noqa: S101 - gated: _take_in found it
        assert head is not None  # noqa: S101 - read by _take_in
        check_content_type(endpoint, head.content_type)
        admission = self._admission
        gate = self._gate
        lane = None
        if self._models.routed:
            # Upstreams serve several models: the request waits in its model's line.
            if endpoint.kind is Kind.AUDIO:
                name = form_field(request.body, head.content_type, "model")
            else:
                name = await model_off_loop(request.body)
            lane = request.lane = _lane(self._models, request, name, self._startup_wait_s > 0)
            admission = lane.admission
            gate = lane.gate
        # A request runs in one upstream, so the largest one's slots bound its weight. (The
        # budget and the clock are read for the request's shape only: which upstream runs it
        # is known once admitted.)
        capacity, budget, cold = admission.bounds()
        unknown = capacity is None
        if unknown:
            if (unreached := self._fleet.unreached) is not None:
                raise UpstreamUnavailable(unreached)
            # llama-server is (re)starting: wait in the queue, weighed once its slot count is
            # known (app/gate/admission.py), and ask it for that now, not at the next tick.
            self._fleet.poke()
        affinity = self._affinity and (
            self._fleet.several if lane is None else len(admission.pools) > 1
        )
        wants = _NOTHING_MORE
        sessions = self._sessions
        if budget or cold or affinity or sessions is not None:
            upstream = self._fleet.primary
            wants = Wants(
                budget=budget,
                default_output=upstream.default_output,
                expect=cold,
                tokens_per_s=upstream.tokens_per_s if cold else None,
                affinity=affinity,
                session=sessions is not None,
            )
        taken = await take_off_loop(
            endpoint,
            request.body,
            _made(
                Reading,
                (
                    _UNSIZED if capacity is None else capacity,
                    self._assemble,
                    # Read only to decide an assembly: a walk over every upstream otherwise wasted.
                    self._fleet.quiet if self._assemble else True,
                    wants,
                ),
            ),
        )
        want, body = taken.demand, taken.body
        request.body = body
        request.stream = want.stream
        request.teaches = taken.teaches
        if taken.assembled:
            # The body was rewritten to ask for a stream already (app/intake/body.py).
            request.assembly = Assembly(
                endpoint.kind, request.path, return_tokens=taken.return_tokens
            )
        weigh: Callable[[int], int] | None = None
        if unknown:
            # Weighed from what intake read, not by parsing the body again on the loop.
            unsized = want

            def weigh(capacity: int) -> int:
                return unsized.at(capacity).weight

        if taken.expected_hold_s is not None:
            admission.expect(taken.expected_hold_s)
        request.weight = want.weight
        cost = taken.estimate
        tenant = request.tenant
        band = None if head.priority is None else tenant.band_for(head.priority)
        if head.max_wait is not None or tenant.max_wait_s is not None:
            request.max_wait_s = deadlines.max_wait_s(head.max_wait, tenant.max_wait_s)
        key, conversation, flow = taken.affinity, taken.conversation, tenant
        if affinity or sessions is not None:
            session = session_of(head.raw)
            if session is not None:
                # An agent's session: each turn back where it last ran (its history is cached
                # there), and, with SESSION_FLOWS, a flow of its own beside its tenant's others.
                if affinity:
                    conversation = routing_key(session)
                    key = conversation if key is None else key
            else:
                # A body's prompt_cache_key routes as its affinity key already; it names a
                # session for the fair order too.
                session = taken.session
            if sessions is not None and session is not None:
                flow = sessions.flow(tenant, session)
        if self.preemption is not None:
            request.band = flow.band if band is None else band
        # At least its choices in one upstream; a prompt array as many slots as it has tasks,
        # up to those of the upstream that grants it.
        # Made by tuple.__new__, as `_made` says, as is the `Reading` above.
        entry = _made(Entry, (
            want.choices, cost.reserve if cost else 0, weigh, key, flow, band,
            conversation, want.choices * want.tasks if want.tasks > 1 else 0,
        ))  # fmt: skip
        ticket = gate.enter_now(entry)
        if ticket is None:  # the shared line: its answer is Redis's
            ticket = await gate.enter(entry)
        if ticket.admitted_at is not None:  # admitted (read without the property's call)
            # Its body no longer counts. Whatever way the request goes, the scope in __call__
            # gives its bytes back at the latest.
            request.held.release()
        elif request.max_wait_s is not None:
            self._in_time(ticket, request.max_wait_s, admission, lane)
        request.ticket = ticket
        request.estimate = cost
        return ticket

    async def _gated_exchange(
        self, request: Request, receive: Receive, answer: Answer, ticket: Claim
    ) -> None:
        """Count, wait for the slot, forward; the client leaving cancels whatever is under way."""
        # The watch's scope, written out: `async with` would cost every request two coroutines.
        watch = Watch(receive, request, answer, self._own, self.running)
        try:
            try:
                # Its body counts while it waits: until admitted, or its wait ends otherwise
                # (a `finally` for the frame's sake, as in `__call__`).
                try:
                    if request.estimate is not None:
                        # Counted exactly while it holds its place (or its slot): a refusal
                        # costs none.
                        lane = request.lane
                        counter = self._fleet.primary if lane is None else self._fleet.of_lane(lane)
                        await counter.count(ticket, request.estimate)
                    if ticket.admitted_at is None:  # not admitted yet
                        # /admission's `waiting` finds it in `running`, by its ticket.
                        awaited = self._wait(request, answer, ticket)
                        if request.max_wait_s is not None:
                            awaited = self._within(awaited, request, ticket)
                        if self.preemption is not None and request.band:
                            awaited = self._patient(awaited, request, ticket)
                        await awaited
                finally:
                    held = request.held
                    if held.bytes:  # nothing held (admitted at once): nothing to give back
                        held.release()
                request.weight = ticket.weight
                endpoint = request.endpoint
                assert endpoint is not None  # noqa: S101 - gated: _take_in found it
                self._metrics.admit(endpoint.route, ticket.wait_s, request.tenant.name)
                # Only a request that goes upstream as a stream is preempted: llama-server stops
                # the work of a non-streamed one whose connection closed only unreliably.
                if self.preemption is None or not (request.stream or request.assembly):
                    await self._forward_when_up(request, answer, ticket)
                else:
                    await self._preemptible(request, answer, ticket)
            except (GateError, AdmissionError) as exc:
                if watch.gone:
                    request.outcome = Outcome.CLIENT_GONE
                    return
                await refuse(request, answer, refusal(exc), self._own)
        except BaseException as exc:
            if not await watch.settle(exc):
                raise
        finally:
            watch.close()

    async def _forward_when_up(self, request: Request, answer: Answer, ticket: Claim) -> None:
        """Forward; while llama-server is restarting (and did not take the request), keep the
        slot and send it again once llama-server is back, within STARTUP_WAIT_S of the first
        refusal (the restarted server runs it in one)."""
        back_by: float | None = None
        resent = False
        while True:
            assert ticket.pool is not None  # noqa: S101 - admitted
            upstream = request.upstream = self._fleet.of(ticket.pool)
            try:
                await self._forward(request, answer)
            except UpstreamStarting as exc:
                if exc.sent and resent:
                    raise
                resent = resent or exc.sent
                if upstream.router is None:
                    upstream.lost(exc.message)
                else:
                    upstream.poke()  # one model of a router, not the router: read it again
                admission = self._admission if request.lane is None else request.lane.admission
                if not self._startup_wait_s and admission.capacity is None:
                    raise  # no other upstream to send it to, and no wait for this one
                if back_by is None:
                    back_by = monotonic() + self._startup_wait_s
                # Back to the head of the line, for whichever upstream has room first.
                ticket.reroute(back_by)
                await self._wait(request, answer, ticket)
            else:
                return

    def _within(self, waiting: Awaitable[None], request: Request, ticket: Claim) -> Awaitable[None]:
        """The wait, out of the line with DeadlineUnmet once its bound (X-Max-Wait) is reached."""
        assert request.max_wait_s is not None  # noqa: S101 - only for a request with a bound
        lane = request.lane
        admission = self._admission if lane is None else lane.admission
        return deadlines.within(
            waiting, request.max_wait_s, ticket.wait_s, lambda: _eta_s(admission, lane, ticket)
        )

    # -- preemption (PREEMPT_AFTER_S) ----------------------------------------------------------

    async def _patient(self, waiting: Awaitable[None], request: Request, ticket: Claim) -> None:
        """Wait; once the wait has lasted PREEMPT_AFTER_S, make room by preempting a lower
        band's request that has sent nothing yet (app/gate/preemption.py)."""
        preemption = self.preemption
        assert preemption is not None  # noqa: S101 - only with preemption on
        task = asyncio.ensure_future(waiting)
        try:
            left_s = preemption.after_s - ticket.wait_s
            done, _ = await asyncio.wait((task,), timeout=max(left_s, 0.0))
            if not done and not ticket.admitted:
                preemption.make_room(request.band, request.id, request.lane)
            await task
        finally:
            task.cancel()

    async def _preemptible(self, request: Request, answer: Answer, ticket: Claim) -> None:
        """Forward, and when preempted before llama-server's first bytes (so before any byte to
        the client), go back to the head of the band and forward again once given a slot."""
        preemption = self.preemption
        task = asyncio.current_task()
        assert preemption is not None  # noqa: S101 - only with preemption on
        assert task is not None  # noqa: S101 - a request runs in a task
        stopped = False

        def stop() -> None:
            nonlocal stopped
            stopped = True
            task.cancel(msg="preempted")

        # Its client has had a byte of the answer (or is about to: its slot went back with
        # llama-server's last byte, its answer not yet written), or llama-server's first token
        # came: an answer assembled from a stream sends its client nothing until it ends, but
        # its tokens so far are work that preempting it would throw away. A stream's head and
        # `: queued` comments, sent while it waited, are slotgate's own: sent again, it relays
        # into the same stream, so a backlog of streams that waited STREAM_HEAD_AFTER_S stays
        # preemptible. One waiting again for a restarting llama-server holds no slot to free.
        started: Callable[[], bool] = lambda: (  # noqa: E731
            answer.bytes_out > 0
            or (answer.started and not answer.stream)
            or ticket.released
            or not ticket.admitted
            or request.first_byte_at is not None
        )
        preemption.run(request, request.band, started, stop, request.id, request.lane)
        try:
            while True:
                try:
                    await self._forward_when_up(request, answer, ticket)
                except asyncio.CancelledError:
                    if not stopped or started() or task.uncancel() > 0:
                        raise
                else:
                    return
                stopped = False
                # Its upstream connection is closed (llama-server stops its work); its slots go
                # to the waiter that preempted it, and it waits at the head of its band.
                ticket.reroute(monotonic() + _PREEMPTED_WAIT_S)
                await self._wait(request, answer, ticket)
        finally:
            preemption.end(request)

    # -- waiting -------------------------------------------------------------------------------

    def _in_time(
        self, ticket: Claim, bound_s: float, admission: Admission, lane: Lane | None
    ) -> None:
        """Refuse at once a request whose place in line promises a slot only past its bound."""
        try:
            deadlines.check(_eta_s(admission, lane, ticket), bound_s)
        except DeadlineUnmet:
            ticket.release()  # its place, before anyone waits behind it for nothing
            raise

    def _wait(self, request: Request, answer: Answer, ticket: Claim) -> Awaitable[None]:
        """Wait for the slot. A plain function handing back what to await: a coroutine frame
        less in every waiter."""
        if request.stream and self._keepalive_s:
            return self._wait_streaming(request, answer, ticket)
        return ticket.wait()

    async def _wait_streaming(self, request: Request, answer: Answer, ticket: Claim) -> None:
        """Wait; once the wait has lasted STREAM_HEAD_AFTER_S, send the stream's head (unless it
        went out) and tell the client where it stands every keep-alive interval.

        The head keeps clients and proxies with idle timeouts from cutting a long wait, but
        whatever fails after it can only be an in-stream error, which the SDKs do not retry;
        before it, a refusal is a 503 or 429 with Retry-After, which they do. Most waits are
        short, so the head waits until the wait is long enough to risk an idle timeout.
        """
        waiting = asyncio.ensure_future(ticket.wait())
        admission = self._admission if request.lane is None else request.lane.admission
        try:
            if not answer.stream:
                if self._head_after_s:
                    done, _ = await asyncio.wait((waiting,), timeout=self._head_after_s)
                    if done:
                        waiting.result()
                        return
                await answer.start(200, [*SSE_HEAD, *self._own_headers(request)], stream=True)
            while True:
                eta = admission.retry_after_s(max(ticket.position, 1))
                await answer.comment(
                    f": queued position={ticket.position} eta_s={eta:.0f}\n\n".encode()
                )
                done, _ = await asyncio.wait((waiting,), timeout=self._keepalive_s)
                if done:
                    waiting.result()
                    return
        finally:
            waiting.cancel()

    # -- the upstream exchange -----------------------------------------------------------------

    async def _forward(self, request: Request, answer: Answer) -> None:
        """Send the request to llama-server and relay its answer. A gated request leaves an
        upstream failure to _gated_exchange, which knows whether its client is still there."""
        target = _quoted(request.path)
        if request.query:
            target += "?" + request.query.decode("latin-1")
        head = request.head
        assert head is not None  # noqa: S101 - read by _take_in
        headers = upstream_headers(
            head.raw, self._drop, head.connection_named, self._auth, request.id
        )
        try:
            # Leaving this block by an exception closes the connection, not pools it, which is
            # what makes llama-server cancel the task behind it.
            upstream = request.upstream
            if upstream is None:  # not gated: any upstream answers it (of its ?model=)
                upstream = request.upstream = self._fleet.serving(request.query)
            response = await upstream.send(request.method, target, headers, request.body)
            if request.ticket is not None:
                # Its slot goes on at llama-server's last byte, from the connection's own
                # callback: before this task, or any other ready then, runs again.
                response.when_done(functools.partial(upstream_done, request, response))
            # The exchange's scope, written out (`async with` costs two coroutines): a normal
            # end releases the response (a complete one pools its connection).
            try:
                await self._relay_answer(request, answer, response)
            except BaseException:
                response.close()
                raise
            response.release()
        except GateError as exc:
            if request.gated or answer.started:
                raise
            await refuse(request, answer, refusal(exc), self._own)

    def _relay_answer(
        self, request: Request, answer: Answer, response: Response
    ) -> Awaitable[None]:
        """Pick the relay mode for llama-server's answer, once, and hand back what to await
        (a plain function: a coroutine frame less for every request)."""
        upstream = request.upstream
        assert upstream is not None  # noqa: S101 - set by _forward
        if response.status > 599:
            # httptools reads any three digits as a status; uvicorn has no status line past
            # 599, and a head it cannot build drops the client's connection without a word.
            raise UpstreamFailed(f"llama-server answered status {response.status}, not HTTP's")
        if not upstream.ready and response.status == 200:
            upstream.poke()  # e.g. its /health: it is back, so read its slot count now
        elif request.gated and response.status == 503 and self._startup_wait_s:
            # llama-server answers 503 to a generation only while it loads the model.
            raise UpstreamStarting("llama-server is loading the model (503); retry shortly")
        if request.origin is not None and self._teaches(request):
            upstream.cors.learn(request.origin, response.headers)
        request.upstream_status = response.status
        if answer.stream:
            return relay_into_stream(request, answer, response)
        if request.assembly is not None and response.content_type == SSE:
            return relay_assembled(request, answer, response, request.assembly, self._own)
        return relay(request, answer, response, self._own)

    # -- answers slotgate makes itself ---------------------------------------------------------

    def _teaches(self, request: Request) -> bool:
        """Whose answers may teach the CORS table (upstreams/cors.py): with keys, one whose key
        was checked (not a preflight, not /health); without keys, one on a generation route,
        where the Origins a browser app uses show up. Anything cheaper for a stranger to send
        could fill the table with made-up Origins."""
        if self._access.enabled:
            return request.method != "OPTIONS" and request.path not in OPEN_PATHS
        return route_of("POST", request.path) is not None

    def _own_headers(self, request: Request) -> Headers:
        """What an answer slotgate makes itself carries (app/proxy/headers.py), with the CORS
        policy of its upstream, or of any before it has one."""
        upstream = request.upstream or self._fleet.primary
        return own_headers(request.id, upstream.cors, request.origin)
