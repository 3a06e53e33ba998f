"""slotgate's HTTP/1.1 server protocol: what uvicorn runs for each connection, on httptools'
parser, with bounds on request heads and a connection's end seen by every request on it.

Its own, not uvicorn's protocol subclassed: uvicorn's request cycle and protocol run for every
request, and as slotgate's own classes they are compiled with their attributes in C structs
(an interpreted base keeps them in a dict Python 3.11 looks up the generic way; bench/README).
uvicorn still runs the server: its sockets, its lifespan, its signals and graceful shutdown,
the `date` header it refreshes; this protocol keeps the contract uvicorn's server and the app
see (the server state's connections and tasks, `shutdown()`, ASGI 3 scopes as uvicorn builds
them, `root_path`, `limit_concurrency`'s 503) and the answers uvicorn's own protocol writes
(app/proxy/cycle.py), which the tests compare byte for byte.

Heads, in size. uvicorn sets no limit on request headers, and httptools gathers a header's
value whole before handing it over: a client could make slotgate hold megabytes of one header
in memory before any check of slotgate's ran (20 MB were taken, then refused), and the same
through the trailers after a chunked body. This protocol counts every byte of a request that is
not body (request line, headers, chunk framing, trailers) as it arrives and, past
HEAD_LIMIT_BYTES, answers 431 in the API's error shape. It then reads and drops what the client
still sends for LINGER_S before it closes: closed at once, the unread bytes would make the
kernel reset the connection, and the answer would be lost with it. Heads under the limit reach
the relay, whose own checks (64 KiB in all, 8 KiB per line) answer with the request's id in the
route's shape.

Heads, in time, and idle connections. A head trickled a byte at a time held its connection for
as long as the client liked. One sweep per server, every SWEEP_S at most, answers 408 to every
connection whose head has been arriving for longer than HEAD_TIMEOUT_S while no request of its
own was in flight (and closes one that has sent nothing for as long), and closes a keep-alive
connection idle for longer than uvicorn's `timeout_keep_alive` since its last answer: a timer
per connection (uvicorn arms and cancels one per request) would cost a heap entry per client,
the sweep one pass. An idle connection is closed within one sweep's interval of its time.

Upgrades and bad bytes. slotgate switches no protocols (no WebSocket, no h2c, no CONNECT): such
a request is answered 400 at once, as are bytes that are not HTTP/1.1, in the API's error
shape. A refusal (400, 431) of bytes that follow requests not answered yet comes after their
answers: written at once, it would be read as the answer to the first of them, or land inside
one being streamed.

Pipelining. A request queued behind another on its connection makes the connection hold what
arrives (up to HOLD_LIMIT_BYTES) rather than stop reading, so a FIN or a reset is seen at once,
and every request still in flight sees the disconnect: a client that sent a generation and a
second request, then left, is noticed, and its generation does not run later for nobody. Past
the hold the socket is paused; the sweep then asks the kernel (poll, POLLRDHUP) whether the
peer has gone.

A connection's end, told. The relay cancels a request whose client left (app/proxy/watch.py's
`Watch`). Through ASGI alone that takes a pending `receive()` wrapped in a task, for every
request that waits: about 1 KB each. `watch_disconnect` has the connection call back instead
when it ends before the request's answer does, through the request's own cycle: no task, and
no object made per request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import select
import urllib.parse
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools
from slotgate.asgi import Headers, Receive, Scope
from slotgate.errors import (
    BadRequest,
    GateError,
    HeadersTooLarge,
    HeadTimeout,
    UpgradeRefused,
    refusal,
)
from slotgate.proxy.cycle import App, Cycle
from slotgate.proxy.headers import id_headers
from slotgate.proxy.refusals import render
from slotgate.proxy.request import request_id
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl
from uvicorn.server import ServerState

log = logging.getLogger("uvicorn.error")
#: The name of each request's task (its request id is not known yet when it starts).
_TASK_NAME = "slotgate-request"

#: A read that ends one request and starts the next is counted whole against the next: reads
#: are at most 256 KiB, so this leaves any head the relay accepts (64 KiB) room to spare,
#: and bounds what httptools gathers, at a cost that grows with the square of a value's size.
HEAD_LIMIT_BYTES = 384 * 1024
LINGER_S = 1.0
#: What a connection holds unparsed while a request waits behind another, and the body a
#: request may have unread before its connection holds what follows (uvicorn's high water mark
#: for a body); past it the socket is paused.
HOLD_LIMIT_BYTES = 64 * 1024
#: The longest pause between sweeps; shorter when HEAD_TIMEOUT_S or the keep-alive is small.
SWEEP_S = 1.0
#: Peer closed its side, or reset: poll's answer for a paused socket whose client left.
_GONE = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}

#: One pending sweep per server (uvicorn's ServerState), while it has connections.
_sweeps: weakref.WeakKeyDictionary[ServerState, asyncio.TimerHandle] = weakref.WeakKeyDictionary()


class Connection(asyncio.Protocol):
    """One client connection: its parser, the request being read, the requests in flight."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        head_timeout_s: float = 0.0,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app: App = config.loaded_app
        self.loop: asyncio.AbstractEventLoop = _loop or asyncio.get_event_loop()
        self.root_path: str = config.root_path
        self.limit_concurrency: int | None = config.limit_concurrency
        self.timeout_keep_alive = float(config.timeout_keep_alive)
        #: Seconds a request head may take to arrive; 0 = no bound.
        self.head_timeout_s = head_timeout_s
        # A fresh context per request, when uvicorn is told to (its `reset_contextvars`).
        self._fresh_context: bool = bool(getattr(config, "reset_contextvars", False))
        self._asgi = {"version": config.asgi_version, "spec_version": "2.3"}
        self.app_state = app_state
        self.server_state = server_state
        self.connections: set[Any] = server_state.connections
        self.tasks: set[asyncio.Task[None]] = server_state.tasks
        self.parser: Any = httptools.HttpRequestParser(self)
        # Answer the first of two pipelined requests even when the second follows a close
        # (httptools 0.6.3 and later).
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.server: tuple[str, int | None] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        # The request being read.
        self.url = b""
        self.headers: Headers = []
        self.scope: Scope = {}
        self.expect_100_continue = False
        #: The newest request; None before the first.
        self.cycle: Cycle | None = None
        #: Requests read while another was in flight, not started yet (the oldest last).
        self.pipeline: deque[tuple[Cycle, App]] = deque()
        # Requests read while another was in flight on this connection, which `cycle` no
        # longer points to; None until there is one.
        self._earlier: list[Cycle] | None = None
        # Flow: reading paused (what arrives is held), writing paused (the transport's buffer
        # is full; sends wait for it to drain).
        self.read_paused = False
        self.write_paused = False
        self._writable: asyncio.Event | None = None
        # Bytes other than body the request being read may still take.
        self._head_left = HEAD_LIMIT_BYTES
        # Refused: what still arrives is dropped until the close.
        self._refused = False
        # The refusal, while requests read whole before the refused bytes are still answered.
        self._refusal: bytes | None = None
        # When the head being read began (loop time); 0 while no head is being read.
        self._head_since = 0.0
        # When the last answer ended with nothing read since (loop time); 0 otherwise.
        self._idle_since = 0.0
        # No byte of a request has arrived yet on this connection.
        self._fresh = True
        # Bytes read while a request waits behind another, not yet parsed.
        self._held = b""
        self._releasing = False
        #: The socket itself is paused (past HOLD_LIMIT_BYTES held).
        self.socket_paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.connections.add(self)
        self.transport = transport
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        if is_ssl(transport):
            self.scheme = "https"
        self._head_since = self.loop.time()
        state = self.server_state
        if state not in _sweeps:
            interval = SWEEP_S
            if self.head_timeout_s:
                interval = min(interval, self.head_timeout_s / 4)
            if self.timeout_keep_alive:
                interval = min(interval, self.timeout_keep_alive / 4)
            _sweeps[state] = self.loop.call_later(interval, _sweep, self.loop, state, interval)

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        self._held = b""
        # Every request in flight learns of it, the oldest first; then each that watches is
        # told, the newest last.
        cycles = [*(self._earlier or ()), *([self.cycle] if self.cycle is not None else ())]
        for cycle in cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
            cycle.wake()
        self.resume_writing()
        if exc is None:
            self.transport.close()
        for cycle in cycles:
            _tell_gone(cycle)
        # As uvicorn does, no cycle of references is left for the garbage collector: the parser
        # calls this connection back, and a request never started points to it (one running
        # lets go when its app returns).
        self.parser = None
        self.cycle = None
        self._earlier = None
        self.pipeline.clear()

    def eof_received(self) -> bool | None:
        return None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._idle_since = 0.0
        if self.read_paused or self._held:
            self._hold(data)
            return
        self._parse(data)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._writable is None:
            self._writable = asyncio.Event()
        self._writable.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            if self._writable is not None:
                self._writable.set()

    async def drain(self) -> None:
        """Until the transport's buffer has drained (or the connection has ended)."""
        if self.write_paused and self._writable is not None:
            await self._writable.wait()

    # -- httptools' callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._head_since = self.loop.time()
        self._fresh = False
        self.url = b""
        self.expect_100_continue = False
        headers: Headers = []
        self.headers = headers
        self.scope = {
            "type": "http",
            "asgi": self._asgi,
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": headers,
            "state": self.app_state.copy(),
        }

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 (5.5) excludes from the value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_since = 0.0
        parser = self.parser
        if parser.should_upgrade():
            self._refuse(
                UpgradeRefused(
                    "slotgate does not switch protocols (Upgrade, CONNECT); send the request "
                    "as plain HTTP/1.1, without Upgrade"
                )
            )
            return
        scope = self.scope
        http_version: str = parser.get_http_version()
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        # Any: httptools' stub says `query` is bytes, and it is None without a query.
        url: Any = httptools.parse_url(self.url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root_path = self.root_path
        if root_path:
            scope["path"] = root_path + path
            scope["raw_path"] = root_path.encode("ascii") + raw_path
        else:
            scope["path"] = path
            scope["raw_path"] = raw_path
        scope["query_string"] = url.query or b""
        app = self.app
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            app = service_unavailable  # type: ignore[assignment]  # uvicorn's ASGI types
            log.warning("Exceeded concurrency limit.")
        previous = self.cycle
        cycle = Cycle(
            self,
            scope,
            http_version != "1.0" and parser.should_keep_alive(),
            self.expect_100_continue,
        )
        self.cycle = cycle
        if previous is None or previous.response_complete:
            self._start(cycle, app)
            return
        # Pipelined: it waits for the answer before it, and what arrives meanwhile is held.
        self.read_paused = True
        self.pipeline.appendleft((cycle, app))
        earlier = [c for c in self._earlier or () if not c.response_complete]
        earlier.append(previous)
        self._earlier = earlier

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._head_left += len(body)
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        cycle.take_body(body)
        if cycle.body_size > HOLD_LIMIT_BYTES:
            self.read_paused = True

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._head_left = HEAD_LIMIT_BYTES
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        cycle.more_body = False
        cycle.wake()

    # -- the requests' ends ----------------------------------------------------------------------

    def on_response_complete(self) -> None:
        """A request's answer is complete: start the next one read, if any."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        # A head begun behind the request just answered gets its full time from now.
        if self._head_since:
            self._head_since = self.loop.time()
        if self._earlier is not None:
            self._earlier = [c for c in self._earlier if not c.response_complete] or None
        if self.read_paused:
            self.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start(cycle, app)
        elif self._refusal is not None:
            answer, self._refusal = self._refusal, None
            self._answer_refusal(answer)
        elif not self._held:
            self._idle_since = self.loop.time()

    def shutdown(self) -> None:
        """uvicorn's server is shutting down: close now if idle, else after this answer."""
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
        else:
            self.cycle.keep_alive = False

    def resume_reading(self) -> None:
        """Read again: parse what was held (on the next turn of the loop, not from inside a
        receive() or a response's end), and unpause the socket."""
        self.read_paused = False
        if self._held and not self._releasing:
            self._releasing = True
            self.loop.call_soon(self._release)
        elif self.socket_paused:
            self.socket_paused = False
            self.transport.resume_reading()

    # -- the sweep -------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Answer 408 if the head being read is past HEAD_TIMEOUT_S; close if idle past the
        keep-alive (called by the sweep)."""
        if self._refused or self._busy():
            return
        since = self._head_since
        if since and self.head_timeout_s and now - since > self.head_timeout_s:
            if self._fresh:
                # Nothing was asked: closed as an idle keep-alive connection is.
                self._refused = True
                self.transport.close()
                return
            self._refuse(
                HeadTimeout(
                    f"request head not complete after {self.head_timeout_s:g} s "
                    "(HEAD_TIMEOUT_S); send the whole head at once"
                )
            )
        elif self._idle_since and now - self._idle_since > self.timeout_keep_alive:
            self.transport.close()

    # -- internals -------------------------------------------------------------------------------

    def _start(self, cycle: Cycle, app: App) -> None:
        context = contextvars.Context() if self._fresh_context else None
        loop = self.loop
        if loop.get_task_factory() is None:
            # The task made as the loop would make it, but named: unnamed, asyncio formats a
            # "Task-N" for each (uvloop's create_task names a task only after making it).
            task = asyncio.Task(cycle.run_asgi(app), loop=loop, name=_TASK_NAME, context=context)
        else:
            task = loop.create_task(cycle.run_asgi(app), context=context)
        cycle.task = task
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _parse(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # refused by on_headers_complete already
        except httptools.HttpParserError:
            self._refuse(
                BadRequest("the request is not valid HTTP/1.1; slotgate could not parse it")
            )
            return
        if self._refused or self.transport.is_closing():
            return
        self._head_left -= len(data)  # the body in it was credited back by on_body
        if self._head_left < 0:
            self._refuse(
                HeadersTooLarge(
                    f"request head is over {HEAD_LIMIT_BYTES} bytes and still not complete"
                )
            )

    def _hold(self, data: bytes) -> None:
        self._held += data
        if len(self._held) > HOLD_LIMIT_BYTES and not self.socket_paused:
            self.socket_paused = True
            self.transport.pause_reading()

    def _release(self) -> None:
        self._releasing = False
        if self.read_paused or self.transport.is_closing() or self._refused:
            return
        data = self._held
        self._held = b""
        self._parse(data)
        if self.socket_paused and not self.transport.is_closing():
            self.socket_paused = False
            self.transport.resume_reading()

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, exc: GateError) -> None:
        self._refused = True
        self._held = b""
        cycle = self.cycle
        # The request the refused bytes are part of, when its head was read (its body was
        # arriving); None when they began a request of their own.
        broken = cycle if cycle is not None and cycle.more_body else None
        if broken is not None and broken.response_complete:
            broken = None
        if broken is not None and broken.response_started:
            # An answer now would land inside its own response being written: close instead.
            self.transport.close()
            return
        status, headers, body = render(refusal(exc), "openai")
        # The request id the relay would have given it: the client's own when it came (and
        # is valid), else a new one.
        headers += id_headers(request_id({"headers": self.headers}))
        head = b"".join(b"%s: %s\r\n" % header for header in headers)
        answer = b"HTTP/1.1 %d %s\r\n%sconnection: close\r\n\r\n%s" % (
            status,
            _REASONS.get(status, b""),
            head,
            body,
        )
        if self.socket_paused:
            self.socket_paused = False
            self.transport.resume_reading()
        if broken is not None and self.pipeline and self.pipeline[0][0] is broken:
            # It waits behind another, and is never started: the refusal is its answer.
            self.pipeline.popleft()
        if any(not c.response_complete for c in self._earlier or ()) or (
            cycle is not None and cycle is not broken and not cycle.response_complete
        ):
            # Requests read whole before the refused bytes are answered first, in their order,
            # and the refusal after them (written now, it would be taken for the answer to the
            # first, or land inside it).
            self._refusal = answer
            return
        self._answer_refusal(answer)

    def _answer_refusal(self, answer: bytes) -> None:
        """Write a refusal, then read and drop what still comes for LINGER_S, and close."""
        self.transport.write(answer)
        self.loop.call_later(LINGER_S, self.transport.close)


def watch_disconnect(receive: Receive, gone: Callable[[], None]) -> Cycle | None:
    """Call `gone` once if the client of the request `receive` belongs to disconnects before
    its answer is complete. The request's cycle, returned, holds `gone` until its `gone` is set
    to None (the watch's end).

    None when `receive` is not a request of this protocol's (another server, or a test
    driving the app with its own), or when its client is gone already: then a pending
    `receive()` tells.
    """
    # The app is handed its cycle's bound `receive`.
    cycle = getattr(receive, "__self__", None)
    if not isinstance(cycle, Cycle) or cycle.disconnected:
        return None
    cycle.gone = gone
    return cycle


def _tell_gone(cycle: Cycle) -> None:
    """The connection ended: call the watch of a request it cut short, once."""
    if cycle.disconnected:
        gone, cycle.gone = cycle.gone, None
        if gone is not None:
            gone()


def http_protocol(head_timeout_s: float) -> type[Connection]:
    """What to give uvicorn as its `http` protocol, with HEAD_TIMEOUT_S set."""

    def connection(
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> Connection:
        return Connection(config, server_state, app_state, _loop, head_timeout_s)

    # uvicorn calls what it is given as a class with these keywords, and asks nothing else of it.
    return connection  # type: ignore[return-value]


def _sweep(loop: asyncio.AbstractEventLoop, state: ServerState, interval: float) -> None:
    now = loop.time()
    paused: dict[int, Connection] = {}
    for connection in list(state.connections):
        if isinstance(connection, Connection):
            connection.expire(now)
            if connection.socket_paused and not connection.transport.is_closing():
                sock = connection.transport.get_extra_info("socket")
                if sock is not None:
                    paused[sock.fileno()] = connection
    if paused:
        poller = select.poll()
        for fd in paused:
            poller.register(fd, _GONE)
        for fd, events in poller.poll(0):
            if events & _GONE:
                paused[fd].transport.abort()
    if state.connections:
        _sweeps[state] = loop.call_later(interval, _sweep, loop, state, interval)
    else:
        _sweeps.pop(state, None)
