"""A small HTTP/1.1 client for one upstream: a keep-alive pool of connections
(app/upstreams/connection.py), streamed bodies, and a response that is closed (never pooled)
when abandoned. What it costs against aiohttp and httpx: `python -m bench.clients`
(bench/README.md).
llama-server's own reuse policy (stream probe, warm spares) is app/upstreams/reuse.py's.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Callable, Iterable
from time import monotonic
from typing import Protocol

from slotgate.asgi import Header
from slotgate.errors import BodyTooLarge, ConnectFailed
from slotgate.upstreams.connection import Connection

_SSE = "text/event-stream"


class Response(Protocol):
    """What the relay needs of an upstream's response: its head, its body as it comes or whole,
    and an end. A Protocol, not the class below: a compiled relay checks the classes it names
    at run time, and any object with these will do (a stand-in upstream's, say)."""

    status: int
    headers: list[Header]
    content_type: str
    content_length: int | None

    def header(self, name: bytes) -> bytes | None: ...

    async def readany(self) -> bytes: ...

    async def read(self, limit_bytes: int | None = None) -> bytes: ...

    def when_done(self, callback: Callable[[], object]) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class PooledResponse:
    """A response whose head has arrived on one of the pool's connections; its body is read as
    it comes."""

    __slots__ = (
        "_client", "_conn", "_done", "_head_only", "_rest", "content_length", "content_type",
        "headers", "status",
    )  # fmt: skip

    def __init__(self, client: Client, conn: Connection, head_only: bool) -> None:
        self._client = client
        self._conn = conn
        self._head_only = head_only
        self._done = False
        #: The body's last bytes, not read yet when the connection went back to the pool.
        self._rest = b""
        self.status = conn.status
        #: As they came, their names lowercased.
        self.headers = conn.headers
        # Both read from the head at once, the first of each: the relay, the read and the
        # release each ask for them (as properties they cost a call each time).
        media = length = None
        for name, value in conn.headers:
            if name == b"content-type":
                if media is None:
                    media = value
            elif name == b"content-length" and length is None:
                length = value
        #: The media type, lowercased, without its parameters ("" if none).
        self.content_type = (
            "" if media is None else media.split(b";", 1)[0].strip().lower().decode("latin-1")
        )
        #: The body's length as the head gives it (None: not given, or not a number).
        self.content_length = int(length) if length is not None and length.isdigit() else None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def readany(self) -> bytes:
        """The next bytes of the body as they arrive; b"" at its end."""
        conn = self._conn
        if self._head_only:
            return b""
        while True:
            if self._done:
                # Released at its end (`when_done`): the connection may carry another
                # exchange already; what was left of this body was kept.
                rest, self._rest = self._rest, b""
                return rest
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
                done = self._done  # released at its end (`when_done`), as in `readany`
                if done or conn._chunks:
                    if done:
                        part, self._rest = self._rest, b""
                    else:
                        part = conn.take()
                    size += len(part)
                    if limit_bytes is not None and size > limit_bytes:
                        raise BodyTooLarge(f"the {self.status} answer is over {limit_bytes} bytes")
                    parts.append(part)
                if done or conn.complete:
                    return b"".join(parts)
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self._client.stall_s)
        finally:
            if not self._done:
                conn.lazy = False

    def when_done(self, callback: Callable[[], object]) -> None:
        """Call `callback` once the body's last byte has arrived, before the reader is woken
        (if it has not arrived yet). The callback may release the response: its connection
        then goes back to the pool at once, and what the reader had not read of the body is
        kept for it."""
        conn = self._conn
        if not (self._done or self._head_only or conn.complete):
            conn.on_end = callback

    def release(self) -> None:
        """Done with it: a complete response gives its connection back to the pool."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        conn.on_end = None
        if conn._chunks:  # released at its end, before the reader took the last bytes
            self._rest = conn.take()
        if conn.poisoned:
            self._client._replace()  # closed when it was poisoned
            return
        if conn.complete and conn.error is None and conn.keep_alive and not self._head_only:
            conn.lazy = False
            self._client._reuse(conn, stream=self.content_type == _SSE)
            return
        conn.close()
        if conn.complete and conn.error is None:
            self._client._replace()

    def close(self) -> None:
        """Abandon it: the connection is closed, never pooled (llama-server then cancels)."""
        if not self._done:
            self._done = True
            conn = self._conn
            conn.on_end = None
            conn.close()


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
    ) -> PooledResponse:
        """Send one request and wait for the response's head."""
        conn = self._take_idle() or await self._connect()
        conn.begin()
        head = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), b"host: ", self._host_header]
        for name, value in headers:
            # Appended one by one: compiled, an append is a fifth of a tuple's concatenation.
            head.append(b"\r\n")
            head.append(name)
            head.append(b": ")
            head.append(value)
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(b"\r\ncontent-length: ")
            head.append(str(len(body)).encode())
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
        return PooledResponse(self, conn, head_only=method == "HEAD")

    def _take_idle(self) -> Connection | None:
        idle = self._idle
        now = monotonic()
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
