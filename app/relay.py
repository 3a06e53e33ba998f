"""The hot path: a plain ASGI app that gates and relays every request slotgate does not own.

It is deliberately framework-free: a request costs one header scan, one body read, one
admission call and one upstream exchange, with llama-server's bytes relayed as they arrive.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import sys
import time
from collections.abc import Callable
from urllib.parse import quote

from .access import OPEN_PATHS, Access
from .admission import Admission, AdmissionError, Ticket
from .asgi import Headers, Message, Receive, Scope, Send
from .assembly import MAX_ASSEMBLED_BYTES, Assembly
from .client import BodyTooLarge, ExchangeFailed, Response
from .endpoints import Demand, Endpoint, check_content_type, demand, route_of
from .errors import (
    BadRequest,
    Flavor,
    GateError,
    HeadersTooLarge,
    PayloadTooLarge,
    QueueBytesFull,
    Refusal,
    UpstreamFailed,
    refusal,
    render,
    stream_event,
)
from .intake import Intake, take_off_loop
from .logs import access as access_log
from .metrics import Metrics
from .pace import expected_hold_s
from .settings import Settings
from .upstream import Upstream, UpstreamStarting

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
#: Headers slotgate decides by, which a client cannot make hop-by-hop through Connection: then
#: slotgate would check or key on one value and llama-server see another, or none.
_DECIDING = _CREDENTIALS | {b"origin"}
_RESPONSE_DROP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
     b"proxy-connection", b"date", b"server"}
)  # fmt: skip
#: An assembled answer is a JSON body of its own: the stream's framing headers do not apply.
_BODY_FRAMING = frozenset({b"content-type", b"content-length", b"x-accel-buffering",
                           b"cache-control"})  # fmt: skip
_SSE_HEAD: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
#: uvicorn sets no bound on header size; llama-server's HTTP library (cpp-httplib) answers a
#: header line over 8 KiB with an empty 400, and only once the request has reached it, slot
#: and all. Anything past these is refused here, before it costs a slot or a connection.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_LINE_BYTES = 8192
#: How long a request runs before slotgate starts watching for its client to leave.
WATCH_AFTER_S = 0.02
#: Non-streamed answers up to this size are read whole before the head goes out.
WHOLE_BODY_BYTES = 1024 * 1024
#: Stands for the unknown slot count while a request is checked before llama-server is up.
_UNSIZED = sys.maxsize
#: The most of an upstream error read to relay it as one event into a waiting stream.
#: llama-server's errors are a few hundred bytes; one longer is no error a client can use.
ERROR_BODY_BYTES = 64 * 1024
_REQUEST_ID_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
_ids = itertools.count(1)
_id_prefix = secrets.token_hex(4)
#: Shared by every request whose Connection header names nothing.
_NONE_NAMED: frozenset[bytes] = frozenset()


class ClientGone(Exception):
    """The client closed its connection; nobody is left to answer."""


class _Exchange:
    """What one request did, for its access-log line and its metrics."""

    __slots__ = (
        "bytes_out", "held_bytes", "id", "method", "origin", "outcome", "path", "route", "sse",
        "started", "status", "tail", "ticket", "upstream_status", "weight",
    )  # fmt: skip

    def __init__(self, request_id: str, method: str, path: str) -> None:
        self.id = request_id
        self.method = method
        self.path = path
        self.route: str | None = None
        self.started = time.monotonic()
        self.status = 0
        self.sse = False  # an event stream's head has gone out: errors now go in-stream
        self.tail = b"\n\n"  # the last bytes relayed into a stream: did they end an event?
        self.upstream_status: int | None = None
        self.outcome = "served"
        self.bytes_out = 0
        self.weight = 0
        self.ticket: Ticket | None = None
        self.origin: bytes | None = None  # the request's Origin, for answers slotgate makes
        self.held_bytes = 0  # of its body, counted against QUEUE_BODY_BYTES while it waits

    async def upstream_done(self, response: Response) -> None:
        """llama-server has sent its last byte: its slot is free, so ours is handed on now,
        before the rest is relayed, and the next request does not wait for the client."""
        response.release()
        if self.ticket is not None and self.ticket.release():
            # Let the waiter just handed the slot send its request before this answer is
            # relayed: llama-server's slot should not sit idle while slotgate writes to a client.
            await asyncio.sleep(0)


class _Watch:
    """Cancels the request's task the moment its client disconnects.

    uvicorn answers `receive()` with `http.disconnect` once the client is gone, so one
    pending `receive()` is the cheapest way to learn of it while the task is busy waiting
    for a slot or for llama-server. The task is cancelled rather than polled, so every
    `finally` on the way out (upstream close, slot release) runs at once. The pending
    `receive()` starts only after WATCH_AFTER_S: a request answered sooner never pays for
    it, and a client leaving in that time is noticed at most that much later.
    """

    __slots__ = ("_pending", "_receive", "_task", "_timer", "done", "gone")

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.current_task()
        self._receive = receive
        self.gone = False
        self.done = False
        self._pending: asyncio.Future[Message] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            WATCH_AFTER_S, self._start
        )

    def _start(self) -> None:
        self._timer = None
        self._pending = asyncio.ensure_future(self._receive())
        self._pending.add_done_callback(self._on_message)

    def _on_message(self, pending: asyncio.Future[Message]) -> None:
        if self.done or pending.cancelled() or pending.exception() is not None:
            return
        if pending.result().get("type") == "http.disconnect" and self._task is not None:
            self.gone = True
            self._task.cancel(msg="client disconnected")

    def stop(self) -> None:
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        if self._pending is not None:
            self._pending.cancel()

    def ours(self) -> bool:
        """After a CancelledError: was it only this watch's doing (so it may end here)?"""
        return self.gone and self._task is not None and self._task.uncancel() == 0


class Proxy:
    """Gate and forward one request to llama-server."""

    def __init__(
        self,
        settings: Settings,
        admission: Admission,
        upstream: Upstream,
        metrics: Metrics,
    ) -> None:
        self._admission = admission
        self._upstream = upstream
        self._metrics = metrics
        self._access = Access(settings.api_keys)
        self._gated = settings.admission_control
        self._body_limit = settings.max_body_bytes
        # Bytes of bodies held by requests waiting in line, bounded by QUEUE_BODY_BYTES (0 = no
        # bound): a body is read whole before its request waits, and the line may be long.
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
        if settings.api_keys or settings.llama_api_key is not None:
            self._drop |= _CREDENTIALS
        self._auth = upstream.auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        ex = _Exchange(_request_id(scope), scope["method"], scope["path"])
        try:
            await self._handle(scope, receive, send, ex)
        finally:
            self._account(ex)

    # -- one request --------------------------------------------------------------------------

    async def _handle(self, scope: Scope, receive: Receive, send: Send, ex: _Exchange) -> None:
        route: Endpoint | None = None  # a generation route, gated or not
        try:
            path = _checked_path(scope["path"])
            # Known first, so that every refusal below is counted under the route and spoken
            # in the route's own error shape.
            route = route_of(ex.method, path)
            if route is not None:
                ex.route = route.route
            endpoint = route if self._gated else None
            head = _RequestHead(scope["headers"])
            ex.origin = head.origin
            if ex.method == "OPTIONS" and self._access.enabled:
                # A browser's CORS preflight carries no key, and no body: llama-server answers
                # it without a key and it starts nothing; so it passes, bodiless, unchecked.
                body = await _preflight_body(receive, head.content_length)
            else:
                self._access.check(path, head.authorization, head.api_key)
                body = await _read_body(receive, head.content_length, self._body_limit)
            if endpoint is None:
                if route is None:
                    await self._forward(scope, send, ex, path, head, body)
                else:
                    await self._forward_ungated(scope, receive, send, ex, path, head, body, route)
                return
            check_content_type(endpoint, head.content_type)
            capacity = self._admission.capacity
            unknown = capacity is None
            if unknown:
                # llama-server is (re)starting: wait in line, weighed once its slot count is
                # known (app/admission.py), and ask it for that now, not at the next tick.
                self._upstream.poke()
            assemble = self._assemble and not self._upstream.verbose
            taken = await take_off_loop(
                endpoint, body, _UNSIZED if capacity is None else capacity, assemble=assemble
            )
            want, body = taken.demand, taken.body
            weigh: Callable[[int], int] | None = None
            if unknown:
                gated, sent = endpoint, body

                def weigh(capacity: int) -> int:
                    return demand(gated, sent, capacity).weight

            if self._admission.cold:
                expected = expected_hold_s(endpoint.kind, body, self._upstream.tokens_per_s)
                if expected is not None:
                    self._admission.expect(expected)
            ex.weight = want.weight
            budget = self._admission.budget_tokens
            cost = self._upstream.estimate(endpoint, body, budget) if budget else None
            ticket = self._admission.enter(want.weight, cost.reserve if cost else 0, weigh)
            if not ticket.admitted:
                self._hold(ex, ticket, len(body))
            ex.ticket = ticket
            if cost is not None:
                # Counted exactly while it holds its place (or its slot): a refusal costs none.
                await self._upstream.count(ticket, cost)
        except (GateError, AdmissionError) as exc:
            await self._refuse(send, ex, refusal(exc), route.flavor if route else "openai")
            return
        except ClientGone:
            ex.outcome = "client_gone"
            return
        await self._gate(scope, receive, send, ex, endpoint, path, head, body, want, taken)

    async def _forward_ungated(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ex: _Exchange,
        path: str,
        head: _RequestHead,
        body: bytes,
        route: Endpoint,
    ) -> None:
        """A generation with ADMISSION_CONTROL off: no slot, but a client that leaves still
        closes the upstream connection, so llama-server stops working for nobody."""
        watch = _Watch(receive)
        try:
            await self._forward(scope, send, ex, path, head, body, route.flavor)
        except asyncio.CancelledError:
            if watch.ours():
                ex.outcome = "client_gone"
                return
            if await self._cut_short(send, ex, route.flavor):
                return
            raise
        finally:
            watch.stop()

    async def _gate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ex: _Exchange,
        endpoint: Endpoint,
        path: str,
        head: _RequestHead,
        body: bytes,
        want: Demand,
        taken: Intake,
    ) -> None:
        ticket = ex.ticket
        assert ticket is not None  # noqa: S101 - set by _handle just before
        watch = _Watch(receive)
        try:
            if not ticket.admitted:
                if want.stream and self._keepalive_s:
                    await self._wait_streaming(send, ex, ticket)
                else:
                    await ticket.wait()
                self._let_go(ex)
            ex.weight = ticket.weight
            self._metrics.admit(endpoint.route, ticket.wait_s)
            # The body was rewritten to ask for a stream already (app/intake.py).
            assembly = (
                Assembly(endpoint.kind, path, return_tokens=taken.return_tokens)
                if taken.assembled
                else None
            )
            back_by: float | None = None
            resent = False
            while True:
                try:
                    await self._forward(
                        scope, send, ex, path, head, body, endpoint.flavor, assembly, gated=True
                    )
                    break
                except UpstreamStarting as exc:
                    # llama-server is restarting and did not take the request: it keeps its
                    # slots (the restarted server runs it in one) and is sent again once
                    # llama-server is back, within STARTUP_WAIT of the first refusal.
                    if not self._startup_wait_s or (exc.sent and resent):
                        raise
                    resent = resent or exc.sent
                    self._upstream.lost(exc.message)
                    if back_by is None:
                        back_by = time.monotonic() + self._startup_wait_s
                    if want.stream and self._keepalive_s:
                        await self._wait_streaming(send, ex, ticket, back_by)
                    else:
                        await self._admission.known(back_by)
        except asyncio.CancelledError:
            if watch.ours():
                ex.outcome = "client_gone"
                return
            if await self._cut_short(send, ex, endpoint.flavor):
                return
            raise
        except (GateError, AdmissionError) as exc:
            if watch.gone:
                ex.outcome = "client_gone"
                return
            r = refusal(exc)
            if ex.sse:
                ex.outcome = r.reason
                await _send_event(send, stream_event(r, endpoint.flavor), ex)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await self._refuse(send, ex, r, endpoint.flavor)
        finally:
            watch.stop()
            self._let_go(ex)
            ticket.release()
            if ticket.admitted_at is not None:
                self._metrics.hold[endpoint.route].observe(time.monotonic() - ticket.admitted_at)

    def _hold(self, ex: _Exchange, ticket: Ticket, size: int) -> None:
        """Count a waiting request's body against QUEUE_BODY_BYTES, or refuse it (429)."""
        limit = self._queue_body_bytes
        if limit and self._held_bytes + size > limit:
            retry_after_s = self._admission.retry_after_s(max(ticket.position, 1))
            ticket.release()
            raise QueueBytesFull(
                f"requests waiting in line already hold {self._held_bytes} bytes of request "
                f"bodies, and {size} more would pass QUEUE_BODY_BYTES ({limit}); retry after "
                "Retry-After",
                self._admission.snapshot(),
                retry_after_s,
            )
        self._held_bytes += size
        ex.held_bytes = size

    def _let_go(self, ex: _Exchange) -> None:
        """The request left the line (admitted or gone): its body no longer counts."""
        self._held_bytes -= ex.held_bytes
        ex.held_bytes = 0

    async def _wait_streaming(
        self,
        send: Send,
        ex: _Exchange,
        ticket: Ticket,
        back_by: float | None = None,
    ) -> None:
        """Wait in line (or, given `back_by`, for llama-server to be back by then); once the
        wait has lasted STREAM_HEAD_AFTER, send the stream's head (unless it went out) and tell
        the client where it stands every keep-alive interval.

        The head keeps clients and proxies with idle timeouts from cutting a long wait, but
        whatever fails after it can only be an in-stream error, which the SDKs do not retry;
        before it, a refusal is a 503 or 429 with Retry-After, which they do. Most waits are
        short, so the head waits until the wait is long enough to risk an idle timeout.
        """
        waiting = asyncio.ensure_future(
            ticket.wait() if back_by is None else self._admission.known(back_by)
        )
        try:
            if not ex.sse:
                if self._head_after_s:
                    done, _ = await asyncio.wait((waiting,), timeout=self._head_after_s)
                    if done:
                        waiting.result()
                        return
                head = [*_SSE_HEAD, *self._own_headers(ex)]
                await send({"type": "http.response.start", "status": 200, "headers": head})
                ex.sse = True
                ex.status = 200
            while True:
                eta = self._admission.retry_after_s(max(ticket.position, 1))
                comment = f": queued position={ticket.position} eta_s={eta:.0f}\n\n".encode()
                await send({"type": "http.response.body", "body": comment, "more_body": True})
                done, _ = await asyncio.wait((waiting,), timeout=self._keepalive_s)
                if done:
                    waiting.result()
                    return
        finally:
            waiting.cancel()

    async def _forward(
        self,
        scope: Scope,
        send: Send,
        ex: _Exchange,
        path: str,
        head: _RequestHead,
        body: bytes,
        flavor: Flavor = "openai",
        assembly: Assembly | None = None,
        *,
        gated: bool = False,
    ) -> None:
        """Send the request to llama-server and relay its answer. A gated request leaves an
        upstream failure to _gate, which knows whether its client is still there."""
        target = quote(path, safe="/:@!$&'()*+,;=-._~")
        query = scope["query_string"]
        if query:
            target += "?" + query.decode("latin-1")
        drop = self._drop
        named = head.connection_named
        headers = [(n, v) for n, v in head.raw if n not in drop and n not in named]
        if self._auth is not None:
            headers.append(self._auth)
        headers.append((b"x-request-id", ex.id.encode()))
        try:
            response = await self._upstream.send(ex.method, target, headers, body)
        except GateError as exc:
            if not gated:
                await self._refuse(send, ex, refusal(exc), flavor)
                return
            raise
        if not self._upstream.ready and response.status == 200:
            self._upstream.poke()  # e.g. its /health: it is back, so read its slot count now
        elif gated and response.status == 503 and self._startup_wait_s:
            # llama-server answers 503 to a generation only while it loads the model.
            response.close()
            raise UpstreamStarting("llama-server is loading the model (503); retry shortly")
        if ex.origin is not None and self._teaches(ex.method, path):
            self._upstream.cors.learn(ex.origin, response.headers)
        clean = False
        try:
            ex.upstream_status = response.status
            if ex.sse:
                await self._relay_into_stream(send, ex, response, flavor)
            elif assembly is not None and response.content_type == "text/event-stream":
                await self._relay_assembled(send, ex, response, flavor, assembly)
            else:
                await self._relay(send, ex, response, flavor)
            clean = True
        finally:
            # A finished exchange returns its connection to the pool; anything else closes it,
            # which is what makes llama-server cancel the task behind it.
            if clean:
                response.release()
            else:
                response.close()

    async def _relay(self, send: Send, ex: _Exchange, response: Response, flavor: Flavor) -> None:
        length = response.content_length
        whole = length is not None and length <= WHOLE_BODY_BYTES
        try:
            # A small body of known length (every non-streamed completion) is read whole, so a
            # truncated one still gets a proper 502; otherwise wait for the first bytes.
            first = await response.read() if whole else await response.readany()
            if whole:
                await ex.upstream_done(response)
            if response.status == 500:
                self._upstream.check_failure(first)
        except ExchangeFailed as exc:
            await self._refuse(send, ex, refusal(_upstream_failure(exc)), flavor)
            return
        headers = [
            (name.lower(), value) for name, value in response.headers if name not in _RESPONSE_DROP
        ]
        headers += _id_headers(ex.id)
        if response.content_type == "text/event-stream":
            ex.sse = True
            present = {name for name, _ in headers}
            headers.extend(h for h in _SSE_HEAD[1:] if h[0] not in present)
        ex.status = response.status
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        if whole:
            ex.bytes_out += len(first)
            await send({"type": "http.response.body", "body": first, "more_body": False})
            return
        chunk = first
        try:
            while chunk:
                ex.bytes_out += len(chunk)
                ex.tail = chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await response.readany()
            await ex.upstream_done(response)
        except ExchangeFailed as exc:
            r = refusal(_upstream_failure(exc))
            ex.outcome = r.reason
            if not ex.sse:
                # A plain body cut short cannot carry an error: leaving the answer unfinished
                # makes the server drop the connection, so the client sees the truncation.
                log.warning("upstream broke off a response after its head: %s", r.message)
                return
            await _send_event(send, stream_event(r, flavor), ex)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay_assembled(
        self,
        send: Send,
        ex: _Exchange,
        response: Response,
        flavor: Flavor,
        assembly: Assembly,
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
            await ex.upstream_done(response)
            status, body = assembly.result()
            if status == 500:
                self._upstream.check_failure(body)
        except ExchangeFailed as exc:
            await self._refuse(send, ex, refusal(_upstream_failure(exc)), flavor)
            return
        except ValueError:
            failure = UpstreamFailed("llama-server sent a stream event that is not JSON")
            await self._refuse(send, ex, refusal(failure), flavor)
            return
        if assembly.verbose and not self._upstream.verbose:
            # Its __verbose object cannot be rebuilt from a stream: from now on such requests
            # go as sent (this one's is the stream's last).
            log.info("llama-server runs with --verbose: non-streamed requests now go as sent")
            self._upstream.verbose = True
        if status != 200:
            ex.outcome = "upstream_error"
        ex.status = status
        ex.bytes_out += len(body)
        # llama-server's own headers (CORS among them), but those of a JSON body of this size.
        headers: Headers = [
            (name.lower(), value)
            for name, value in response.headers
            if name not in _RESPONSE_DROP and name not in _BODY_FRAMING
        ]
        headers += [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            *_id_headers(ex.id),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _relay_into_stream(
        self, send: Send, ex: _Exchange, response: Response, flavor: Flavor
    ) -> None:
        """Relay into an SSE stream whose 200 head went out while the request waited."""
        try:
            if response.status != 200 or response.content_type != "text/event-stream":
                # llama-server refused (e.g. the prompt exceeds the context): its JSON error
                # becomes the stream's error event, as llama-server itself does mid-stream.
                error = await response.read(ERROR_BODY_BYTES)
                self._upstream.check_failure(error)
                await ex.upstream_done(response)
                ex.outcome = "upstream_error"
                prefix = b"event: error\n" if flavor == "anthropic" else b""
                await _send_event(send, prefix + b"data: " + error.strip() + b"\n\n", ex)
            else:
                while chunk := await response.readany():
                    ex.bytes_out += len(chunk)
                    ex.tail = chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await ex.upstream_done(response)
        except ExchangeFailed as exc:
            r = refusal(_upstream_failure(exc))
            ex.outcome = r.reason
            await _send_event(send, stream_event(r, flavor), ex)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _cut_short(self, send: Send, ex: _Exchange, flavor: Flavor) -> bool:
        """Cancelled from outside: the drain timeout ran out at shutdown. Tell the client
        while its answer can still carry an error; True when it was told.

        Then the task may end normally, as uvicorn's shutdown wants, rather than log an error
        with a traceback for every request the drain timeout cut. A plain answer whose head
        went out can only be left unfinished, which the client sees as a truncation.
        """
        if not (ex.sse or ex.status == 0):
            return False
        ex.outcome = "shutdown"
        message = "slotgate shut down before this request finished"
        cut = Refusal(503, "unavailable_error", "shutting_down", message, "internal")
        await _final_words(send, cut, flavor, ex, self._own_headers(ex))
        return True

    def _teaches(self, method: str, path: str) -> bool:
        """Whose answers may teach the CORS table (app/cors.py): with keys, a request whose key
        was checked (not a preflight, not /health); without keys, one on a generation route,
        where the Origins a browser app uses show up. Anything cheaper for a stranger to send
        could fill the table with made-up Origins."""
        if self._access.enabled:
            return method != "OPTIONS" and path not in OPEN_PATHS
        return route_of("POST", path) is not None

    def _own_headers(self, ex: _Exchange) -> Headers:
        """What an answer slotgate makes itself carries: the request id, and the CORS header
        llama-server would give the request's Origin (app/cors.py)."""
        return [*_id_headers(ex.id), *self._upstream.cors.headers_for(ex.origin)]

    async def _refuse(self, send: Send, ex: _Exchange, r: Refusal, flavor: Flavor) -> None:
        ex.outcome = r.reason
        status, headers, body = render(r, flavor)
        headers += self._own_headers(ex)
        ex.status = status
        ex.bytes_out += len(body)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _account(self, ex: _Exchange) -> None:
        if ex.route is not None and ex.outcome not in ("served", "upstream_error"):
            reason = ex.outcome if ex.outcome != "shutdown" else "upstream_unavailable"
            self._metrics.rejected(ex.route, reason)
        if not access_log.isEnabledFor(logging.INFO):
            return
        ticket = ex.ticket
        hold = (
            round(time.monotonic() - ticket.admitted_at, 4)
            if ticket is not None and ticket.admitted_at is not None
            else None
        )
        access_log.info(
            "%s %s %d %s",
            ex.method, ex.path, ex.status, ex.outcome,
            extra={
                "request_id": ex.id,
                "route": ex.route,
                "outcome": ex.outcome,
                "status": ex.status,
                "upstream_status": ex.upstream_status,
                "weight": ex.weight,
                "queue_wait_s": round(ticket.wait_s, 4) if ticket is not None else None,
                "slot_hold_s": hold,
                "bytes_out": ex.bytes_out,
                "duration_s": round(time.monotonic() - ex.started, 4),
            },
        )  # fmt: skip


class _RequestHead:
    """The request headers slotgate looks at, found in one pass."""

    __slots__ = (
        "api_key", "authorization", "connection_named", "content_length", "content_type",
        "origin", "raw",
    )  # fmt: skip

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self.authorization: bytes | None = None
        self.api_key: bytes | None = None
        self.content_length: int | None = None
        self.content_type = ""
        self.origin: bytes | None = None
        self.connection_named = _NONE_NAMED
        size = 0
        for name, value in raw:
            line = len(name) + len(value) + 4  # name: value CRLF, as llama-server counts it
            if line > MAX_HEADER_LINE_BYTES:
                raise HeadersTooLarge(
                    f"request header {name[:64].decode('latin-1')} is longer than "
                    f"{MAX_HEADER_LINE_BYTES} bytes, which llama-server refuses"
                )
            size += line
            if name == b"content-length":
                if not value.isdigit():
                    raise BadRequest("Content-Length is not a number")
                self.content_length = int(value)
            elif name == b"content-type":
                self.content_type = value.decode("latin-1")
            elif name == b"authorization":
                self.authorization = value
            elif name == b"x-api-key":
                self.api_key = value
            elif name == b"origin":
                # llama-server reads the first; one value only, so both sides read the same.
                if self.origin is not None:
                    raise BadRequest("more than one Origin header")
                self.origin = value
            elif name == b"connection":
                # Headers named in Connection are hop-by-hop too, but never ones slotgate
                # itself decides by: a client cannot make the gate drop what it checked.
                named = {part.strip().lower() for part in value.split(b",")}
                self.connection_named = frozenset(named - _DECIDING)
        if size > MAX_HEADER_BYTES:
            raise HeadersTooLarge(f"request headers exceed {MAX_HEADER_BYTES} bytes")


def _checked_path(path: str) -> str:
    """The decoded path, refused when it could step outside llama-server's root."""
    if not path.startswith("/") or "\\" in path or "\x00" in path:
        raise BadRequest("request path is not a plain absolute path")
    if "/./" in path + "/" or "/../" in path + "/":
        raise BadRequest("request path must not contain '.' or '..' segments")
    return path


async def _read_body(receive: Receive, declared: int | None, limit: int) -> bytes:
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"request body is {declared} bytes; the limit is {limit} (MAX_BODY_BYTES)"
        )
    message = await receive()
    # A client that closed before its body was whole (or sent broken chunked framing, which
    # uvicorn answers 400 and closes): nothing it sent may go upstream, not even the head.
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    # A chunked body declares no length, and may arrive whole in one message.
    if len(body) > limit:
        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes (MAX_BODY_BYTES)")
    if not message.get("more_body", False):
        return _whole(body, declared)
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"request body is over the limit of {limit} bytes (MAX_BODY_BYTES)"
            )
        chunks.append(chunk)
    return _whole(b"".join(chunks), declared)


def _whole(body: bytes, declared: int | None) -> bytes:
    if declared is not None and len(body) != declared:
        raise BadRequest(f"request body is {len(body)} bytes, not the {declared} declared")
    return body


async def _preflight_body(receive: Receive, declared: int | None) -> bytes:
    try:
        return await _read_body(receive, declared, 0)
    except PayloadTooLarge:
        raise BadRequest(
            "an OPTIONS request without a key is a preflight, and has no body"
        ) from None


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if 0 < len(value) <= 128 and all(c in _REQUEST_ID_CHARS for c in value):
                return bytes(value).decode()
            break
    return f"{_id_prefix}-{next(_ids)}"


def _id_headers(request_id: str) -> Headers:
    """The request id under both names clients read: `x-request-id` (OpenAI's SDKs) and
    `request-id` (Anthropic's, for the `request_id` of its responses and errors)."""
    value = request_id.encode()
    return [(b"x-request-id", value), (b"request-id", value)]


def _upstream_failure(exc: BaseException) -> UpstreamFailed:
    if isinstance(exc, TimeoutError):
        return UpstreamFailed("llama-server went silent for longer than UPSTREAM_STALL_TIMEOUT")
    if isinstance(exc, BodyTooLarge):
        return UpstreamFailed(f"llama-server's error could not be relayed: {exc}")
    return UpstreamFailed(f"llama-server broke off the response ({type(exc).__name__})")


async def _send_event(send: Send, event: bytes, ex: _Exchange) -> None:
    event = _on_boundary(ex, event)
    ex.bytes_out += len(event)
    await send({"type": "http.response.body", "body": event, "more_body": True})


async def _final_words(
    send: Send, r: Refusal, flavor: Flavor, ex: _Exchange, own_headers: Headers
) -> None:
    """Best effort, during cancellation: end the answer with an error rather than silence."""
    try:
        async with asyncio.timeout(1.0):
            if ex.sse:
                await send({"type": "http.response.body",
                            "body": _on_boundary(ex, stream_event(r, flavor)),
                            "more_body": False})  # fmt: skip
            else:
                status, headers, body = render(r, flavor)
                ex.status = status
                headers += own_headers
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
    except (OSError, RuntimeError, TimeoutError):
        log.debug("could not tell a cancelled client why", exc_info=True)


def _on_boundary(ex: _Exchange, event: bytes) -> bytes:
    """The event, after a blank line if the bytes relayed last left an event unfinished (the
    upstream cut mid-event): glued on, it would become part of that event's last line."""
    if ex.tail.endswith((b"\n\n", b"\r\n\r\n")):
        return event
    return b"\n\n" + event
