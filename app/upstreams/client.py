"""A small HTTP/1.1 client for one upstream: connections with an explicit state, a keep-alive
pool, httptools parsing, streamed bodies, and a response that is closed (never pooled) when
abandoned. What it costs against aiohttp and httpx: `python -m bench.clients`
(bench/README.md).
llama-server's own reuse policy (stream probe, warm spares) is app/upstreams/reuse.py's.
"""

from __future__ import annotations

import asyncio
import enum
import os
import select
import ssl
import time
from collections.abc import Callable, Iterable
from typing import cast

import httptools
from slotgate.asgi import Header
from slotgate.errors import (
    BodyTooLarge,
    ConnectFailed,
    Disconnected,
    ExchangeFailed,
    ProtocolError,
    Stalled,
)

#: Body bytes buffered from a connection before it stops reading from the socket; beyond this
#: the upstream's own socket buffer fills and llama-server's writes block (backpressure).
HIGH_WATER_BYTES = 64 * 1024
_SSE = "text/event-stream"
#: The most a response head (interim 1xx heads included) may take. llama-server's heads are a
#: few hundred bytes; this is slotgate's own bound on request heads (relay.MAX_HEADER_BYTES),
#: and it is counted before the parser sees the bytes, so a huge head costs no more than this.
MAX_HEAD_BYTES = 64 * 1024


class _Surplus(Exception):
    """A second response began on a connection whose response was already complete."""


class State(enum.Enum):
    NEW = "new"  # connected, never used
    ACTIVE = "active"  # carrying a request and its response
    IDLE = "idle"  # its response is done; pooled for the next request
    CLOSED = "closed"  # by either side, or poisoned


class Connection(asyncio.Protocol):
    """One TCP connection, carrying one response at a time: NEW, then ACTIVE and IDLE in
    turn, and CLOSED at the end."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.state = State.NEW
        self._parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        self._data_at = 0.0
        self.carried_stream = False
        #: It sent bytes nobody asked for (while idle, or past its response): closed, and
        #: never reused.
        self.poisoned = False
        #: A response is awaited: from the request's sending to its response's end.
        self.expecting = False
        #: Called once if the connection closes while held aside after a stream.
        self.on_lost: Callable[[], None] | None = None
        # Kept from connection_made: Python 3.11's asyncio.get_running_loop() makes a getpid
        # system call, and `wait` runs at least once per exchange.
        self._loop: asyncio.AbstractEventLoop | None = None
        # The socket's own poll, registered once: reuse asks it before every exchange.
        self._poll: select.poll | None = None
        self._reset()

    def __repr__(self) -> str:
        flags = " poisoned" if self.poisoned else ""
        if self.state is State.ACTIVE:
            flags += f" status={self.status}" if self.head_done else " awaiting head"
            flags += " complete" if self.complete else ""
        return f"<Connection [{self.state.name}{flags}]>"

    def is_idle(self) -> bool:
        return self.state is State.IDLE

    def is_closed(self) -> bool:
        """Closed, or closing: by this side, or by the peer as far as the loop has seen."""
        transport = self.transport
        return self.state is State.CLOSED or transport is None or transport.is_closing()

    def has_expired(self, now: float, keepalive_s: float) -> bool:
        """Pooled for longer than `keepalive_s`, closed, or no longer quiet: not reusable.

        Also asked of the kernel: a FIN or stray bytes that arrived since the loop last
        looked would otherwise fail the next request or be read as its response.
        """
        return now - self.idle_since > keepalive_s or self.is_closed() or _peer_closed(self)

    def peer_closed(self) -> bool:
        """Closed, as far as the kernel knows (it sees what the loop has not read yet)."""
        return self.is_closed() or _peer_closed(self)

    def begin(self) -> None:
        """A request goes out on it now."""
        self._reset()
        self.state = State.ACTIVE
        self.expecting = True

    def pooled(self) -> None:
        if self.state is not State.NEW:  # a spare opened ahead of need stays NEW
            self.state = State.IDLE
        self.idle_since = time.monotonic()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[Header] = []
        self.head_done = False
        self.complete = False
        self._head_bytes = 0
        self._interim = False  # the head just parsed is a 1xx: the real one is still to come
        self._refusal: ExchangeFailed | None = None  # why a parser callback stopped the parser
        self.keep_alive = False
        self.error: ExchangeFailed | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        #: Wake the reader only at the end (or at the high-water mark): Response.read.
        self.lazy = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self._data_at = time.monotonic()
        if not self.expecting:
            # Idle, or its response is complete: whatever this is, it answers no request, and
            # parsed, it would become part of the next request's response.
            self._poison()
            return
        if not self.head_done:
            room = MAX_HEAD_BYTES - self._head_bytes
            if len(data) > room:
                self._head_bytes = MAX_HEAD_BYTES
                if not self._feed(data[:room]):
                    return
                if not self.head_done:
                    self._fail(ProtocolError(f"response head is over {MAX_HEAD_BYTES} bytes"))
                    self.close()
                    return
                self.data_received(data[room:])
                return
            self._head_bytes += len(data)
        self._feed(data)

    def _feed(self, data: bytes) -> bool:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.complete:
                self._poison()  # a complete response, then bytes past its end
            else:
                self._fail(
                    self._refusal
                    or ProtocolError(f"upstream answered something that is not HTTP ({exc})")
                )
                self.close()
            return False
        return True

    def _poison(self) -> None:
        self.poisoned = True
        self.expecting = False
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._poll = None
        self.state = State.CLOSED
        if not self.complete:
            self._fail(Disconnected("upstream closed the connection mid-response"))
        on_lost, self.on_lost = self.on_lost, None
        if on_lost is not None:
            on_lost()

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Surplus

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                self._refusal = ProtocolError("upstream switched protocols (101); not relayed")
                raise self._refusal
            # 100 Continue, 103 Early Hints: informational, the real answer follows.
            self._interim = True
            self.headers = []
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        if not self.lazy or self._paused:
            self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.expecting = False
        self._wake()

    # -- used by Response ---------------------------------------------------------------------

    def _fail(self, error: ExchangeFailed) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, stall_s: float | None) -> None:
        """Until something arrives (head, body, end or an error), or the stall timeout.

        A plain timer that fails the waiter costs a fraction of an `asyncio.timeout` scope,
        and this runs once per body chunk.
        """
        loop = self._loop or asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        if stall_s is not None:
            self._stall_timer = loop.call_later(stall_s, self._stalled, stall_s)
        try:
            await waiter
        finally:
            self._waiter = None
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

    def _stalled(self, stall_s: float) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        # A lazy reader is not woken by every chunk: bytes may have come in meanwhile.
        quiet_s = time.monotonic() - self._data_at
        if quiet_s < stall_s:
            loop = self._loop or asyncio.get_running_loop()
            self._stall_timer = loop.call_later(stall_s - quiet_s, self._stalled, stall_s)
            return
        waiter.set_exception(Stalled(f"upstream sent nothing for {stall_s:g} s"))

    def take(self) -> bytes:
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.state = State.CLOSED
        self._poll = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None


def _peer_closed(conn: Connection) -> bool:
    """Has the peer's FIN (or anything at all) arrived on this idle connection's socket?

    Asked of the kernel, so it also sees what the loop has not read yet. A quiet, open
    keep-alive connection is not readable; a closed one, or one holding bytes nobody asked
    for, is, and is no connection to reuse. The poll is the connection's own, made on first
    use: each reuse then costs the one system call and no allocation.
    """
    transport = conn.transport
    if transport is None:
        return True
    poll = conn._poll
    if poll is None:
        sock = transport.get_extra_info("socket")
        if sock is None:
            return True
        poll = conn._poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
    return bool(poll.poll(0))


class Response:
    """A response whose head has arrived; its body is read as it comes."""

    __slots__ = ("_client", "_conn", "_done", "_head_only", "_type", "headers", "status")

    def __init__(self, client: Client, conn: Connection, head_only: bool) -> None:
        self._client = client
        self._conn = conn
        self._head_only = head_only
        self._done = False
        self.status = conn.status
        self.headers = conn.headers
        self._type: str | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def content_type(self) -> str:
        # Read once: the relay and the release each ask for it.
        media = self._type
        if media is None:
            value = self.header(b"content-type") or b""
            media = self._type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        return media

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        return int(value) if value is not None and value.isdigit() else None

    async def readany(self) -> bytes:
        """The next bytes of the body as they arrive; b"" at its end."""
        conn = self._conn
        if self._head_only:
            return b""
        while True:
            if conn._chunks:
                return conn.take()
            if conn.complete:
                return b""
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._client.stall_s)

    async def read(self, limit_bytes: int | None = None) -> bytes:
        """The whole body, waking once at its end rather than at every chunk.

        An assembled answer from llama-server comes one token per chunk: woken for each, the
        reader would spend a task switch per token on bytes it only needs at the end.
        A body longer than `limit_bytes` raises BodyTooLarge once that much has arrived.
        """
        conn = self._conn
        if self._head_only:
            return b""
        length = self.content_length
        if limit_bytes is not None and length is not None and length > limit_bytes:
            raise BodyTooLarge(f"the {self.status} answer is {length} bytes, over {limit_bytes}")
        parts = []
        size = 0
        conn.lazy = True
        try:
            while True:
                if conn._chunks:
                    part = conn.take()
                    size += len(part)
                    if limit_bytes is not None and size > limit_bytes:
                        raise BodyTooLarge(f"the {self.status} answer is over {limit_bytes} bytes")
                    parts.append(part)
                if conn.complete:
                    return b"".join(parts)
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._client.stall_s)
        finally:
            conn.lazy = False

    def release(self) -> None:
        """Done with it: a complete response gives its connection back to the pool."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.poisoned:
            self._client._replace()  # closed when it was poisoned
            return
        if conn.complete and conn.error is None and conn.keep_alive and not self._head_only:
            self._client._reuse(conn, stream=self.content_type == _SSE)
            return
        conn.close()
        if conn.complete and conn.error is None:
            self._client._replace()

    def close(self) -> None:
        """Abandon it: the connection is closed, never pooled (llama-server then cancels)."""
        if not self._done:
            self._done = True
            self._conn.close()


class Client:
    """Connections to one host:port, reused while they are fresh; no limit on their number
    (the admission pool bounds the work, and a limit here would be a second, hidden queue).

    The hooks `_reuse`, `_replace`, `_closed_while_idle` and `_unreachable` are where an
    upstream's own reuse policy goes (app/upstreams/reuse.py); here they pool or do nothing.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        tls: bool,
        connect_timeout_s: float,
        keepalive_s: float,
        stall_s: float | None,
        address: str | None = None,
    ) -> None:
        self._host = host
        # Where to connect, when not to `host` itself: one of the addresses a name resolves to
        # (the Host header and TLS's server name stay the name).
        self._address = address or host
        self._port = port
        self._ssl = ssl.create_default_context() if tls else None
        # An IPv6 literal goes in brackets, as in a URL (RFC 9110 section 7.2).
        self._host_header = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode("idna")
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self.stall_s = stall_s
        self._idle: list[Connection] = []
        self._closed = False
        self._started()

    def _started(self) -> None:
        """Hook: a reuse policy's own state, made once the client is."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._host}:{self._port} idle={len(self._idle)}>"

    def connect_to(self, address: str | None) -> None:
        """Open new connections to `address` (one of those `host` resolves to; None: `host`)."""
        self._address = address or self._host

    async def request(
        self, method: str, target: str, headers: Iterable[Header], body: bytes
    ) -> Response:
        """Send one request and wait for the response's head."""
        conn = self._take_idle() or await self._connect()
        conn.begin()
        head = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), b"host: ", self._host_header]
        for name, value in headers:
            head += (b"\r\n", name, b": ", value)
        if body or method in ("POST", "PUT", "PATCH"):
            head += (b"\r\ncontent-length: ", str(len(body)).encode())
        head.append(b"\r\n\r\n")
        transport = conn.transport
        assert transport is not None  # noqa: S101 - fresh or checked by _take_idle
        # A small body goes out with the head, in one write and one copy.
        small = len(body) < 65536
        if small:
            head.append(body)
        transport.write(b"".join(head))
        if not small:
            transport.write(body)
        stall_s = self.stall_s
        # Waited for here, not in a coroutine of its own: every wake-up on the way to the head
        # would resume one frame more.
        while not conn.head_done:
            if conn.error is not None:
                conn.close()
                raise conn.error
            try:
                await conn.wait(stall_s)
            except BaseException:
                conn.close()
                raise
        return Response(self, conn, head_only=method == "HEAD")

    def _take_idle(self) -> Connection | None:
        idle = self._idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            # llama-server drops idle connections after 5 s; one that may be closing under us
            # could swallow a POST that cannot be retried, so stale ones are closed instead.
            if conn.is_closed():
                self._closed_while_idle(conn, now)
                continue
            if conn.has_expired(now, self._keepalive_s):
                conn.close()
                continue
            return conn
        return None

    def _give_back(self, conn: Connection) -> None:
        if self._closed or conn.transport is None:
            conn.close()
            return
        conn.pooled()
        self._idle.append(conn)

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    Connection,
                    self._address,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectFailed(
                f"connecting to {self._address}:{self._port} took over "
                f"{self._connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            self._unreachable()
            # "Connection refused", not uvloop's "Connect call failed ('127.0.0.1', 8080)".
            why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else str(exc)
            raise ConnectFailed(f"cannot connect to {self._address}:{self._port} ({why})") from None
        return conn

    # -- hooks for an upstream's reuse policy ---------------------------------------------------

    def _reuse(self, conn: Connection, *, stream: bool) -> None:
        """A complete response whose connection may be reused is released."""
        self._give_back(conn)

    def _replace(self) -> None:
        """A finished exchange's connection could not be reused."""

    def _closed_while_idle(self, conn: Connection, now: float) -> None:
        """A pooled connection was found closed by the peer."""

    def _unreachable(self) -> None:
        """A connection attempt failed: the upstream is away."""

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
