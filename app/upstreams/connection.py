"""One HTTP/1.1 connection to an upstream (`Connection`): an explicit state (NEW, ACTIVE,
IDLE, CLOSED), httptools parsing, a bounded response head, a body buffered up to a high-water
mark. The pool and the response that use it are app/upstreams/client.py's.
"""

from __future__ import annotations

import asyncio
import enum
import select
from collections.abc import Callable
from time import monotonic
from typing import cast

import httptools
from slotgate.asgi import Header
from slotgate.errors import (
    Disconnected,
    ExchangeFailed,
    ProtocolError,
    Stalled,
)

#: Body bytes buffered from a connection before it stops reading from the socket; beyond this
#: the upstream's own socket buffer fills and llama-server's writes block (backpressure).
HIGH_WATER_BYTES = 64 * 1024
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


#: Read once: on Python 3.11 an enum member looked up on its class costs about 0.1 us, and
#: every request reads a few of these.
_NEW, _ACTIVE, _IDLE, _CLOSED = State.NEW, State.ACTIVE, State.IDLE, State.CLOSED


class Connection(asyncio.Protocol):
    """One TCP connection, carrying one response at a time: NEW, then ACTIVE and IDLE in
    turn, and CLOSED at the end."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.state = _NEW
        self._parser = httptools.HttpResponseParser(self)
        self.idle_since = 0.0
        # When bytes last arrived, and when the current (or last) wait began: the stall timer
        # measures silence from the later of the two.
        self._data_at = 0.0
        self._wait_since = 0.0
        # Armed by the first wait and kept across waits and exchanges, re-armed only when it
        # fires: a timer made and cancelled per wait would cost two per request (about 2 us
        # each under uvloop), where this costs one per connection per stall timeout.
        self._stall_timer: asyncio.TimerHandle | None = None
        self.carried_stream = False
        #: It sent bytes nobody asked for (while idle, or past its response): closed, and
        #: never reused.
        self.poisoned = False
        #: A response is awaited: from the request's sending to its response's end.
        self.expecting = False
        #: Called once if the connection closes while held aside after a stream.
        self.on_lost: Callable[[], None] | None = None
        #: Called once when the response's last byte has been parsed, before its reader is
        #: woken (`PooledResponse.when_done`).
        self.on_end: Callable[[], object] | None = None
        # Kept from connection_made: Python 3.11's asyncio.get_running_loop() makes a getpid
        # system call, and `wait` runs at least once per exchange.
        self._loop: asyncio.AbstractEventLoop | None = None
        # The socket's own poll, registered once: reuse asks it before every exchange.
        self._poll: select.poll | None = None
        self._reset()

    def __repr__(self) -> str:
        flags = " poisoned" if self.poisoned else ""
        if self.state is _ACTIVE:
            flags += f" status={self.status}" if self.head_done else " awaiting head"
            flags += " complete" if self.complete else ""
        return f"<Connection [{self.state.name}{flags}]>"

    def is_idle(self) -> bool:
        return self.state is _IDLE

    def is_closed(self) -> bool:
        """Closed, or closing: by this side, or by the peer as far as the loop has seen."""
        transport = self.transport
        return self.state is _CLOSED or transport is None or transport.is_closing()

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
        self.state = _ACTIVE
        self.expecting = True

    def pooled(self) -> None:
        if self.state is not _NEW:  # a spare opened ahead of need stays NEW
            self.state = _IDLE
        self.idle_since = monotonic()

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
        #: Body or end parsed: the reader is to be woken once the parser returns (`_feed`).
        self._wake_due = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        #: Wake the reader only at the end (or at the high-water mark): Response.read.
        self.lazy = False

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        self._data_at = monotonic()
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
        fed = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            fed = False
            if self.complete:
                self._poison()  # a complete response, then bytes past its end
            else:
                self._fail(
                    self._refusal
                    or ProtocolError(f"upstream answered something that is not HTTP ({exc})")
                )
                self.close()
        # The reader is woken once per read, after the parse: the end's callback, if any, goes
        # first, so that whoever it wakes runs before the reader does.
        if self._wake_due:
            self._wake_due = False
            if self.complete and self.on_end is not None:
                self._ended()
            else:
                self._wake()
        return fed

    def _ended(self) -> None:
        """The response is complete and someone asked to know at once: tell them, then wake the
        reader. Here, once the parser has returned, not in its callback: what they do may give
        this connection back to the pool, and bytes past the end (parsed after the callback, in
        the same feed) must still find it complete, to poison it."""
        on_end, self.on_end = self.on_end, None
        try:
            if on_end is not None and not self.poisoned:
                on_end()
        finally:
            # Whatever it raised (the loop reports it), the reader is not left waiting.
            self._wake()

    def _poison(self) -> None:
        self.poisoned = True
        self.expecting = False
        self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._poll = None
        self.state = _CLOSED
        self._disarm()
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
        # Past the head these are a chunked body's trailers: no header of the answer (taken for
        # one, a trailing Content-Type would give the client two).
        if not self.head_done:
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
            self._wake_due = True

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.expecting = False
        self._wake_due = True

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
        """Until something arrives (head, body, end or an error), or `stall_s` seconds of
        silence from the upstream since the later of this wait's start and the last bytes.

        A plain timer that fails the waiter costs a fraction of an `asyncio.timeout` scope,
        and this runs once per body chunk; the timer is the connection's, armed once and
        kept (`_stalled`).
        """
        loop = self._loop or asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        if stall_s is not None:
            self._wait_since = monotonic()
            if self._stall_timer is None:
                self._stall_timer = loop.call_later(stall_s, self._stalled, stall_s)
        try:
            await waiter
        finally:
            # A response handed on at its end (`on_end`) may leave this connection to the
            # next exchange, whose own wait may have begun before this one resumes.
            if self._waiter is waiter:
                self._waiter = None

    def _disarm(self) -> None:
        """Closed: its stall timer would keep it alive until due."""
        timer, self._stall_timer = self._stall_timer, None
        if timer is not None:
            timer.cancel()

    def _stalled(self, stall_s: float) -> None:
        """The stall timer is due: fail the wait under way if the upstream has been silent for
        `stall_s` since it began (and since its last bytes), else arm again for the rest;
        with nobody waiting, disarm (the next wait arms it)."""
        self._stall_timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self.state is _CLOSED:
            return
        # Bytes may have come in, or a new wait begun, since the timer was armed.
        quiet_s = monotonic() - max(self._data_at, self._wait_since)
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
        self.state = _CLOSED
        self._poll = None
        self._disarm()
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
