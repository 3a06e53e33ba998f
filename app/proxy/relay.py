"""The hot path: a plain ASGI app that gates every request slotgate does not own and relays
llama-server's answer as it comes. A request is a `Request` (app/proxy/request.py), its answer an
`Answer` (app/proxy/answer.py); this module holds the relay modes and the orchestration.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import quote

import orjson
from slotgate.asgi import Headers, Message, Receive, Scope, Send
from slotgate.errors import (
    GateError,
    QueueBytesFull,
    Refusal,
    UpstreamFailed,
    UpstreamUnavailable,
    refusal,
    stream_event,
)
from slotgate.gate.admission import Admission, AdmissionError, NotReady, TenantTooLarge
from slotgate.gate.ticket import Claim
from slotgate.intake.body import Wants, take_off_loop
from slotgate.intake.endpoints import check_content_type, route_of
from slotgate.logs import Client
from slotgate.logs import access as access_log
from slotgate.metrics import Metrics
from slotgate.proxy.access import OPEN_PATHS, Access
from slotgate.proxy.answer import Answer
from slotgate.proxy.assembly import MAX_ASSEMBLED_BYTES, Assembly
from slotgate.proxy.protocol import DisconnectWatch, watch_disconnect
from slotgate.proxy.request import (
    ClientGone,
    Head,
    Request,
    checked_path,
    id_headers,
    preflight_body,
    read_body,
)
from slotgate.settings import Settings
from slotgate.upstreams.client import BodyTooLarge, ExchangeFailed, Response
from slotgate.upstreams.cors import CorsPolicy
from slotgate.upstreams.fleet import Fleet
from slotgate.upstreams.upstream import UpstreamStarting

if TYPE_CHECKING:
    # Imported only with REDIS_URL set (app/main.py): without it no Redis code is loaded.
    from slotgate.replicas.replica import ReplicaAdmission

log = logging.getLogger("slotgate.relay")

# RFC 9110 section 7.6.1 connection-specific fields, plus the ones a proxy sets itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
        b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
        b"host", b"content-length", b"expect",
    }
)  # fmt: skip
_CREDENTIALS = frozenset({b"authorization", b"x-api-key"})
_RESPONSE_DROP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
     b"proxy-connection", b"date", b"server"}
)  # fmt: skip
#: An assembled answer is a JSON body of its own: the stream's framing headers do not apply.
_BODY_FRAMING = frozenset({b"content-type", b"content-length", b"x-accel-buffering",
                           b"cache-control"})  # fmt: skip
_SSE = "text/event-stream"
_SSE_HEAD: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: How long a request runs before slotgate starts watching for its client to leave.
WATCH_AFTER_S = 0.02
#: Non-streamed answers up to this size are read whole before the head goes out.
WHOLE_BODY_BYTES = 1024 * 1024
#: Stands for the unknown slot count while a request is checked before llama-server is up.
_UNSIZED = sys.maxsize
#: The most of an upstream error read to relay it as one event into a waiting stream.
#: llama-server's errors are a few hundred bytes; one longer is no error a client can use.
ERROR_BODY_BYTES = 64 * 1024


class _Watch:
    """Cancels the request's task the moment its client disconnects.

    Under slotgate's own uvicorn protocol the connection says so when it ends
    (app/proxy/protocol.py's `watch_disconnect`). Elsewhere uvicorn, like any ASGI server, answers
    `receive()` with `http.disconnect` once the client is gone, so one pending `receive()`,
    as a task, learns of it while the request's own task is busy waiting for a slot or for
    llama-server. The task is cancelled rather than polled, so every `finally` on the way out
    (upstream close, slot release) runs at once. The watch starts only after WATCH_AFTER_S:
    a request answered sooner never pays for it, and a client leaving in that time is
    noticed at most that much later.
    """

    __slots__ = ("_connection", "_pending", "_receive", "_task", "_timer", "done", "gone")

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.current_task()
        self._receive = receive
        self.gone = False
        self.done = False
        self._connection: DisconnectWatch | None = None
        self._pending: asyncio.Future[Message] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            WATCH_AFTER_S, self._start
        )

    def _start(self) -> None:
        self._timer = None
        self._connection = watch_disconnect(self._receive, self._disconnected)
        if self._connection is None:
            self._pending = asyncio.ensure_future(self._receive())
            self._pending.add_done_callback(self._on_message)

    def _on_message(self, pending: asyncio.Future[Message]) -> None:
        if pending.cancelled() or pending.exception() is not None:
            return
        if pending.result().get("type") == "http.disconnect":
            self._disconnected()

    def _disconnected(self) -> None:
        if not self.done and self._task is not None:
            self.gone = True
            self._task.cancel(msg="client disconnected")

    def stop(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._connection is not None:
            self._connection.cancel()
        if self._pending is not None:
            self._pending.cancel()

    def __enter__(self) -> _Watch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def ours(self) -> bool:
        """After a CancelledError: was it only this watch's doing (so it may end here)?"""
        return self.gone and self._task is not None and self._task.uncancel() == 0


class Proxy:
    """Gate and forward one request to llama-server."""

    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        fleet: Fleet,
        metrics: Metrics,
        access: Access | None = None,
        replica: ReplicaAdmission | None = None,
    ) -> None:
        self._admission = admission
        #: The fleet's line shared with other replicas through Redis (REDIS_URL), if any.
        self._replica = replica
        self._fleet = fleet
        # Affinity keys are read only when there is something to choose between.
        self._affinity = settings.routing == "affinity"
        self._metrics = metrics
        self._access = access or Access(settings.api_keys, settings.api_keys_file)
        self._gated = settings.admission_control
        self._body_limit = settings.max_body_bytes
        # Bytes of gated bodies not yet admitted (being read, parsed, or waiting in the queue),
        # bounded by QUEUE_BODY_BYTES (0 = no bound): a body is read whole before its request
        # waits, and the queue may be long.
        self._queue_body_bytes = settings.queue_body_bytes
        self._held_bytes = 0
        self._keepalive_s = settings.keepalive_interval
        self._head_after_s = settings.stream_head_after
        self._startup_wait_s = settings.startup_wait
        self._assemble = settings.stream_upstream
        # The request id llama-server logs is slotgate's: the client's own when it is valid.
        self._drop = {*_HOP_BY_HOP, b"x-request-id"}
        if not settings.forward_conversation_id:
            self._drop.add(b"x-conversation-id")
        # Whoever checks or supplies credentials keeps the client's to itself.
        if self._access.enabled or settings.llama_api_key is not None:
            self._drop |= _CREDENTIALS
        self._auth = fleet.primary.auth

    # -- one request, top to bottom ------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # One coroutine, not one that makes the request and one that serves it: every frame a
        # waiting request is suspended in costs it about 270 bytes.
        if scope["type"] != "http":
            return
        request = Request(scope)
        answer = Answer(send)
        try:
            try:
                await self._take_in(request, receive)
                if not request.gated:
                    await self._pass(request, receive, answer)
                    return
                ticket = await self._enter(request)
            except (GateError, AdmissionError) as exc:
                self._let_go(request)
                await self._refuse(request, answer, refusal(exc))
                return
            except ClientGone:
                self._let_go(request)
                request.outcome = "client_gone"
                return
            # The one place its slot (or its place in the queue) is given back, whatever
            # happens.
            async with ticket:
                await self._gated_exchange(request, receive, answer, ticket)
        finally:
            self._let_go(request)  # cancelled mid-read or mid-parse (shutdown) too
            self._account(request, answer)

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
            count = partial(self._count, request) if request.gated else None
            request.body = await read_body(receive, head.content_length, self._body_limit, count)

    async def _pass(self, request: Request, receive: Receive, answer: Answer) -> None:
        """Forward a request that takes no slot. A generation with ADMISSION_CONTROL off still
        closes its upstream connection when its client leaves, so llama-server stops working
        for nobody."""
        if request.endpoint is None:
            await self._forward(request, answer)
            return
        with _Watch(receive) as watch:
            try:
                await self._forward(request, answer)
            except asyncio.CancelledError:
                if watch.ours():
                    request.outcome = "client_gone"
                    return
                if await self._cut_short(request, answer):
                    return
                raise

    async def _enter(self, request: Request) -> Claim:
        """Read the body's demand and join the queue (or take a slot at once)."""
        endpoint = request.endpoint
        head = request.head
        assert endpoint is not None  # noqa: S101 - gated: _take_in found it
        assert head is not None  # noqa: S101 - read by _take_in
        check_content_type(endpoint, head.content_type)
        # A request runs in one upstream, so the largest one's slots bound its weight.
        capacity = self._admission.largest
        unknown = capacity is None
        if unknown:
            if (unreached := self._fleet.unreached) is not None:
                raise UpstreamUnavailable(unreached)
            # llama-server is (re)starting: wait in the queue, weighed once its slot count is
            # known (app/gate/admission.py), and ask it for that now, not at the next tick.
            self._fleet.poke()
        # Read for the request's shape only: which upstream runs it is known once admitted.
        upstream = self._fleet.primary
        cold = self._admission.cold
        wants = Wants(
            budget=self._admission.budget_tokens,
            default_output=upstream.default_output,
            expect=cold,
            tokens_per_s=upstream.tokens_per_s if cold else None,
            affinity=self._affinity and self._fleet.several,
        )
        taken = await take_off_loop(
            endpoint,
            request.body,
            _UNSIZED if capacity is None else capacity,
            assemble=self._assemble,
            quiet=self._fleet.quiet,
            wants=wants,
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
            self._admission.expect(taken.expected_hold_s)
        request.weight = want.weight
        cost = taken.estimate
        tenant = request.tenant
        band = None if head.priority is None else tenant.band_for(head.priority)
        ticket: Claim
        if self._replica is not None:
            if weigh is not None:
                # No upstream known to this replica yet: the shared line has no startup wait.
                raise NotReady(self._admission.snapshot(), 1.0)
            limit = tenant.max_active
            if limit is not None and want.weight > limit:
                # It could never run within its tenant's limit: refused before Redis is asked.
                raise TenantTooLarge(self._admission.snapshot(), want.weight, tenant)
            # As below: the shared line weighs a prompt array where it grants it.
            ticket = await self._replica.enter(
                want.choices, cost.reserve if cost else 0, taken.affinity,
                tenant=tenant, band=band, conversation=taken.conversation,
                tasks=want.choices * want.tasks if want.tasks > 1 else 0,
            )  # fmt: skip
        else:
            # At least its choices in one upstream; a prompt array as many slots as it has
            # tasks, up to those of the upstream that grants it.
            ticket = self._admission.enter(
                want.choices, cost.reserve if cost else 0, weigh, taken.affinity,
                tenant=tenant, band=band, conversation=taken.conversation,
                tasks=want.choices * want.tasks if want.tasks > 1 else 0,
            )  # fmt: skip
        if ticket.admitted:
            self._let_go(request)
        request.ticket = ticket
        request.estimate = cost
        return ticket

    async def _gated_exchange(
        self, request: Request, receive: Receive, answer: Answer, ticket: Claim
    ) -> None:
        """Count, wait for the slot, forward; the client leaving cancels whatever is under way."""
        with _Watch(receive) as watch:
            try:
                if request.estimate is not None:
                    # Counted exactly while it holds its place (or its slot): a refusal costs
                    # none.
                    await self._fleet.primary.count(ticket, request.estimate)
                if not ticket.admitted:
                    await self._wait(request, answer, ticket)
                    self._let_go(request)
                request.weight = ticket.weight
                self._metrics.admit(request.route or "", ticket.wait_s, request.tenant.name)
                await self._forward_when_up(request, answer, ticket)
            except asyncio.CancelledError:
                if watch.ours():
                    request.outcome = "client_gone"
                    return
                if await self._cut_short(request, answer):
                    return
                raise
            except (GateError, AdmissionError) as exc:
                if watch.gone:
                    request.outcome = "client_gone"
                    return
                await self._refuse(request, answer, refusal(exc))
            finally:
                self._let_go(request)

    async def _forward_when_up(self, request: Request, answer: Answer, ticket: Claim) -> None:
        """Forward; while llama-server is restarting (and did not take the request), keep the
        slot and send it again once llama-server is back, within STARTUP_WAIT of the first
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
                upstream.lost(exc.message)
                if not self._startup_wait_s and self._admission.capacity is None:
                    raise  # no other upstream to send it to, and no wait for this one
                if back_by is None:
                    back_by = time.monotonic() + self._startup_wait_s
                # Back to the head of the line, for whichever upstream has room first.
                ticket.reroute(back_by)
                await self._wait(request, answer, ticket)
            else:
                return

    # -- waiting -------------------------------------------------------------------------------

    def _count(self, request: Request, size: int) -> None:
        """Count `size` more bytes of a gated body, before they are read, against
        QUEUE_BODY_BYTES, or refuse it (429). A body alone is let in whatever its size
        (MAX_BODY_BYTES bounds it), so a bound below that refuses no body for good."""
        limit = self._queue_body_bytes
        others = self._held_bytes - request.held_bytes
        if limit and others and self._held_bytes + size > limit:
            raise QueueBytesFull(
                f"requests not yet admitted already hold {others} bytes of request bodies "
                f"(being read or waiting in the queue), and {request.held_bytes + size} would "
                f"pass QUEUE_BODY_BYTES ({limit}); retry after Retry-After",
                self._admission.snapshot(),
                self._admission.retry_after_s(self._admission.queued + 1),
            )
        self._held_bytes += size
        request.held_bytes += size

    def _let_go(self, request: Request) -> None:
        """The request was admitted or left: its body no longer counts."""
        self._held_bytes -= request.held_bytes
        request.held_bytes = 0

    def _wait(self, request: Request, answer: Answer, ticket: Claim) -> Awaitable[None]:
        """Wait for the slot. A plain function handing back what to await: a coroutine frame
        less in every waiter."""
        if request.stream and self._keepalive_s:
            return self._wait_streaming(request, answer, ticket)
        return ticket.wait()

    async def _wait_streaming(self, request: Request, answer: Answer, ticket: Claim) -> None:
        """Wait; once the wait has lasted STREAM_HEAD_AFTER, send the stream's head (unless it
        went out) and tell the client where it stands every keep-alive interval.

        The head keeps clients and proxies with idle timeouts from cutting a long wait, but
        whatever fails after it can only be an in-stream error, which the SDKs do not retry;
        before it, a refusal is a 503 or 429 with Retry-After, which they do. Most waits are
        short, so the head waits until the wait is long enough to risk an idle timeout.
        """
        waiting = asyncio.ensure_future(ticket.wait())
        try:
            if not answer.stream:
                if self._head_after_s:
                    done, _ = await asyncio.wait((waiting,), timeout=self._head_after_s)
                    if done:
                        waiting.result()
                        return
                await answer.start(200, [*_SSE_HEAD, *self._own_headers(request)], stream=True)
            while True:
                eta = self._admission.retry_after_s(max(ticket.position, 1))
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
        target = quote(request.path, safe="/:@!$&'()*+,;=-._~")
        if request.query:
            target += "?" + request.query.decode("latin-1")
        head = request.head
        assert head is not None  # noqa: S101 - read by _take_in
        drop = self._drop
        named = head.connection_named
        headers = [(n, v) for n, v in head.raw if n not in drop and n not in named]
        if self._auth is not None:
            headers.append(self._auth)
        headers.append((b"x-request-id", request.id.encode()))
        try:
            # Leaving this block by an exception closes the connection, not pools it, which is
            # what makes llama-server cancel the task behind it.
            upstream = request.upstream
            if upstream is None:  # not gated: any upstream answers it
                upstream = request.upstream = self._fleet.primary
            async with upstream.request(request.method, target, headers, request.body) as r:
                await self._relay_answer(request, answer, r)
        except GateError as exc:
            if request.gated or answer.started:
                raise
            await self._refuse(request, answer, refusal(exc))

    async def _relay_answer(self, request: Request, answer: Answer, response: Response) -> None:
        """Pick the relay mode for llama-server's answer, once."""
        upstream = request.upstream
        assert upstream is not None  # noqa: S101 - set by _forward
        if not upstream.ready and response.status == 200:
            upstream.poke()  # e.g. its /health: it is back, so read its slot count now
        elif request.gated and response.status == 503 and self._startup_wait_s:
            # llama-server answers 503 to a generation only while it loads the model.
            raise UpstreamStarting("llama-server is loading the model (503); retry shortly")
        if request.origin is not None and self._teaches(request):
            upstream.cors.learn(request.origin, response.headers)
        request.upstream_status = response.status
        if answer.stream:
            await self._relay_into_stream(request, answer, response)
        elif request.assembly is not None and response.content_type == _SSE:
            await self._relay_assembled(request, answer, response, request.assembly)
        else:
            await self._relay(request, answer, response)

    async def _upstream_done(self, request: Request, response: Response) -> None:
        """llama-server has sent its last byte: its slot is free, so ours is handed on now,
        before the rest is relayed, and the next request does not wait for the client."""
        response.release()
        if request.ticket is not None and request.ticket.release():
            # Let the waiter just handed the slot send its request (or, sharing the line
            # through Redis, the release leave for Redis) before this answer is relayed:
            # llama-server's slot should not sit idle while slotgate writes to a client.
            await asyncio.sleep(0)

    def _failed(self, request: Request, body: bytes) -> None:
        """A generation failed with 500: let its upstream see whether its cache ran out."""
        if request.upstream is not None:
            request.upstream.check_failure(body)

    def _learn_verbose(self, request: Request, body: bytes) -> None:
        """A non-streamed answer to a body that left `verbose` to llama-server shows whether it
        adds `__verbose` unasked (--verbose): nothing else does (not /props, not /slots).

        Learning it from the first such answer, per upstream and again after each restart,
        costs those few requests their assembly (their cancellation is less prompt) and no
        round trip of its own; a probe would take a slot outside the gate. Parsed, not
        searched: a completion's text may hold the word. Only while unknown."""
        upstream = request.upstream
        if upstream is None or upstream.verbose is not None:
            return
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if not isinstance(answer, dict):
            return
        upstream.verbose = "__verbose" in answer
        if upstream.verbose:
            log.info("llama-server runs with --verbose: non-streamed requests go as sent")

    # -- relay modes ---------------------------------------------------------------------------

    async def _relay(self, request: Request, answer: Answer, response: Response) -> None:
        """Relay llama-server's answer as it is: a small body whole, anything else as it comes."""
        length = response.content_length
        whole = length is not None and length <= WHOLE_BODY_BYTES
        try:
            # A small body of known length (every non-streamed completion) is read whole, so a
            # truncated one still gets a proper 502; otherwise wait for the first bytes.
            first = await response.read() if whole else await response.readany()
            if whole:
                await self._upstream_done(request, response)
                if request.teaches and response.status == 200:
                    self._learn_verbose(request, first)
            if response.status == 500:
                self._failed(request, first)
        except ExchangeFailed as exc:
            await self._refuse(request, answer, refusal(_upstream_failure(exc)))
            return
        headers = [
            (name.lower(), value) for name, value in response.headers if name not in _RESPONSE_DROP
        ]
        headers += id_headers(request.id)
        if request.origin is not None:
            CorsPolicy.expose(headers)
        stream = response.content_type == _SSE
        if stream:
            present = {name for name, _ in headers}
            headers.extend(h for h in _SSE_HEAD[1:] if h[0] not in present)
        await answer.start(response.status, headers, stream=stream)
        if whole:
            await answer.end(first)
            return
        chunk = first
        try:
            while chunk:
                await answer.relay(chunk)
                chunk = await response.readany()
            await self._upstream_done(request, response)
        except ExchangeFailed as exc:
            r = refusal(_upstream_failure(exc))
            request.outcome = r.reason
            if not answer.stream:
                # A plain body cut short cannot carry an error: leaving the answer unfinished
                # makes the server drop the connection, so the client sees the truncation.
                log.warning("upstream broke off a response after its head: %s", r.message)
                return
            await answer.event(stream_event(r, request.flavor))
        await answer.end()

    async def _relay_assembled(
        self, request: Request, answer: Answer, response: Response, assembly: Assembly
    ) -> None:
        """Answer a non-streamed request from the stream slotgate asked llama-server for."""
        try:
            while chunk := await response.readany():
                assembly.feed(chunk)
                if assembly.size > MAX_ASSEMBLED_BYTES:
                    # Raised, not answered here: the connection is closed, not pooled, and
                    # llama-server stops generating.
                    raise UpstreamFailed(
                        f"llama-server's answer exceeds {MAX_ASSEMBLED_BYTES} bytes, the most "
                        "slotgate assembles for a non-streamed request; ask for a stream "
                        "(stream: true) or fewer tokens"
                    )
            await self._upstream_done(request, response)
            status, body = assembly.result()
            if status == 500:
                self._failed(request, body)
        except ExchangeFailed as exc:
            await self._refuse(request, answer, refusal(_upstream_failure(exc)))
            return
        except ValueError:
            failure = UpstreamFailed("llama-server sent a stream event that is not JSON")
            await self._refuse(request, answer, refusal(failure))
            return
        upstream = request.upstream
        assert upstream is not None  # noqa: S101 - set by _forward
        if assembly.verbose and upstream.verbose is not True:
            # Restarted with --verbose unseen: its __verbose object cannot be rebuilt from a
            # stream, so from now on such requests go as sent (this one's is missing).
            log.info("llama-server runs with --verbose: non-streamed requests now go as sent")
            upstream.verbose = True
        if status != 200:
            request.outcome = "upstream_error"
        # llama-server's own headers (CORS among them), but those of a JSON body of this size.
        headers: Headers = [
            (name.lower(), value)
            for name, value in response.headers
            if name not in _RESPONSE_DROP and name not in _BODY_FRAMING
        ]
        headers += [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            *id_headers(request.id),
        ]
        if request.origin is not None:
            CorsPolicy.expose(headers)
        await answer.whole(status, headers, body)

    async def _relay_into_stream(
        self, request: Request, answer: Answer, response: Response
    ) -> None:
        """Relay into an SSE stream whose 200 head went out while the request waited."""
        try:
            if response.status != 200 or response.content_type != _SSE:
                # llama-server refused (e.g. the prompt exceeds the context): its JSON error
                # becomes the stream's error event, as llama-server itself does mid-stream.
                error = await response.read(ERROR_BODY_BYTES)
                self._failed(request, error)
                await self._upstream_done(request, response)
                request.outcome = "upstream_error"
                prefix = b"event: error\n" if request.flavor == "anthropic" else b""
                await answer.event(prefix + b"data: " + error.strip() + b"\n\n")
            else:
                while chunk := await response.readany():
                    await answer.relay(chunk)
                await self._upstream_done(request, response)
        except ExchangeFailed as exc:
            r = refusal(_upstream_failure(exc))
            request.outcome = r.reason
            await answer.event(stream_event(r, request.flavor))
        await answer.end()

    # -- answers slotgate makes itself ---------------------------------------------------------

    async def _refuse(self, request: Request, answer: Answer, r: Refusal) -> None:
        request.outcome = r.reason
        await answer.refuse(r, request.flavor, self._own_headers(request))

    async def _cut_short(self, request: Request, answer: Answer) -> bool:
        """Cancelled from outside: the drain timeout ran out at shutdown. Tell the client
        while its answer can still carry an error; True when it was told.

        Then the task may end normally, as uvicorn's shutdown wants, rather than log an error
        with a traceback for every request the drain timeout cut. A plain answer whose head
        went out can only be left unfinished, which the client sees as a truncation.
        """
        message = "slotgate shut down before this request finished"
        cut = Refusal(503, "unavailable_error", "shutting_down", message, "internal")
        if answer.ending:
            # Whole but for its last send: end it as meant (final_words only sends the end
            # again); the client was served.
            await answer.final_words(cut, request.flavor, [])
            return True
        if answer.started and not answer.stream:
            return False
        request.outcome = "shutdown"
        await answer.final_words(cut, request.flavor, self._own_headers(request))
        return True

    def _teaches(self, request: Request) -> bool:
        """Whose answers may teach the CORS table (upstreams/cors.py): with keys, one whose key
        was checked (not a preflight, not /health); without keys, one on a generation route,
        where the Origins a browser app uses show up. Anything cheaper for a stranger to send
        could fill the table with made-up Origins."""
        if self._access.enabled:
            return request.method != "OPTIONS" and request.path not in OPEN_PATHS
        return route_of("POST", request.path) is not None

    def _own_headers(self, request: Request) -> Headers:
        """What an answer slotgate makes itself carries: the request id, and the CORS header
        llama-server would give the request's Origin (app/upstreams/cors.py)."""
        upstream = request.upstream or self._fleet.primary
        return [*id_headers(request.id), *upstream.cors.headers_for(request.origin)]

    def _account(self, request: Request, answer: Answer) -> None:
        """Its metrics and its access-log line, once it is over."""
        route = request.route
        ticket = request.ticket
        now = time.monotonic()
        if route is not None and request.outcome not in ("served", "upstream_error"):
            reason = request.outcome if request.outcome != "shutdown" else "upstream_unavailable"
            self._metrics.rejected(route, reason, request.tenant.name)
            if ticket is not None and request.upstream is None:
                # It waited and never got a slot (an admitted request has its upstream; its
                # wait was observed when it was admitted).
                self._metrics.waited(route, ticket.wait_s, reason, request.tenant.name)
        hold_s = None
        if ticket is not None and ticket.admitted_at is not None:
            hold_s = now - ticket.admitted_at
            if route is not None:
                self._metrics.held(route, hold_s, request.tenant.name, ticket.weight)
        if not access_log.isEnabledFor(logging.INFO):
            return
        access_log.info(
            "%s %s %d %s",
            Client(request.method), Client(request.path), answer.status, request.outcome,
            extra={
                "request_id": request.id,
                "tenant": request.tenant.name,
                "route": route,
                "outcome": request.outcome,
                "status": answer.status,
                "upstream": request.upstream.url if request.upstream is not None else None,
                "upstream_status": request.upstream_status,
                "weight": request.weight,
                "queue_wait_s": round(ticket.wait_s, 4) if ticket is not None else None,
                "slot_hold_s": round(hold_s, 4) if hold_s is not None else None,
                "bytes_out": answer.bytes_out,
                "duration_s": round(now - request.started, 4),
            },
        )  # fmt: skip


def _upstream_failure(exc: BaseException) -> UpstreamFailed:
    if isinstance(exc, TimeoutError):
        return UpstreamFailed("llama-server went silent for longer than UPSTREAM_STALL_TIMEOUT")
    if isinstance(exc, BodyTooLarge):
        return UpstreamFailed(f"llama-server's error could not be relayed: {exc}")
    return UpstreamFailed(f"llama-server broke off the response ({type(exc).__name__})")
