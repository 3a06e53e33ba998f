"""uvicorn's httptools protocol, with bounds on request heads and a connection's end seen by
every request on it.

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

Heads, in time. A head trickled a byte at a time held its connection for as long as the client
liked. One sweep per server, every SWEEP_S at most, answers 408 to every connection whose head
has been arriving for longer than HEAD_TIMEOUT_S while no request of its own was in flight (and
closes one that has sent nothing for as long): a timer per connection would cost a heap entry
per waiting client, the sweep one pass.

Upgrades and bad bytes. slotgate switches no protocols (no WebSocket, no h2c, no CONNECT);
uvicorn would hand such a request to its WebSocket layer or leave it waiting for a body the
parser never delivers. It is answered 400 at once, as are bytes that are not HTTP/1.1 (uvicorn
answered those in plain text), in the API's error shape.

Pipelining. uvicorn marks only the newest request on a connection as disconnected when the
connection ends, and stops reading the socket while a request waits behind another: a client
that sent a generation and a second request, then left, was never noticed, and its generation
ran later for nobody. Here every request still in flight sees the disconnect, and a request
queued behind another makes the connection hold what arrives (up to HOLD_LIMIT_BYTES) rather
than stop reading, so a FIN or a reset is seen at once. Past the hold the socket is paused; the
sweep then asks the kernel (poll, POLLRDHUP) whether the peer has gone.

A connection's end, told. The relay cancels a request whose client left (app/proxy/watch.py's
`Watch`). Through ASGI alone that takes a pending `receive()` wrapped in a task, for every
request that waits: about 1 KB each. `watch_disconnect` has the connection call back instead
when it ends before the request's answer does, at the moment uvicorn would mark that request
disconnected, through the request's own cycle (app/proxy/cycle.py): no task, and no object
made per request.
"""

from __future__ import annotations

import asyncio
import select
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from slotgate.asgi import Receive
from slotgate.errors import (
    BadRequest,
    GateError,
    HeadersTooLarge,
    HeadTimeout,
    UpgradeRefused,
    refusal,
)
from slotgate.proxy.cycle import Cycle
from slotgate.proxy.headers import id_headers
from slotgate.proxy.refusals import render
from slotgate.proxy.request import request_id
from uvicorn.protocols.http import httptools_impl as _uvicorn_module
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

#: A read that ends one request and starts the next is counted whole against the next: reads
#: are at most 256 KiB, so this leaves any head the relay accepts (64 KiB) room to spare,
#: and bounds what httptools gathers, at a cost that grows with the square of a value's size.
HEAD_LIMIT_BYTES = 384 * 1024
LINGER_S = 1.0
#: What a connection holds unparsed while a request waits behind another (uvicorn's own high
#: water mark for a body); past it the socket is paused.
HOLD_LIMIT_BYTES = 64 * 1024
#: The longest pause between sweeps; shorter when HEAD_TIMEOUT_S is small.
SWEEP_S = 1.0
#: Peer closed its side, or reset: poll's answer for a paused socket whose client left.
_GONE = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}

#: One pending sweep per server (uvicorn's ServerState), while it has connections.
_sweeps: weakref.WeakKeyDictionary[ServerState, asyncio.TimerHandle] = weakref.WeakKeyDictionary()


#: uvicorn's own callbacks, called by name: on Python 3.11 `super()` makes an object and a
#: method lookup the interpreter cannot specialize, and these run for every request.
_uvicorn_data_received = HttpToolsProtocol.data_received
_uvicorn_on_message_begin = HttpToolsProtocol.on_message_begin
_uvicorn_on_headers_complete = HttpToolsProtocol.on_headers_complete
_uvicorn_on_body = HttpToolsProtocol.on_body
_uvicorn_on_message_complete = HttpToolsProtocol.on_message_complete
_uvicorn_on_response_complete = HttpToolsProtocol.on_response_complete
# The names uvicorn's protocol module holds (`on_headers_complete` rebinds one): set through its
# dict, as a module's attribute set is a lookup Python 3.11 cannot specialize.
_uvicorn_names = vars(_uvicorn_module)


class BoundedHeadProtocol(HttpToolsProtocol):
    # Slots: uvicorn's own attributes fill the instance dict to the brim, and a few more
    # would double it (1.5 KB a connection).
    __slots__ = (
        "_earlier", "_fresh", "_head_left", "_head_since", "_held", "_releasing", "socket_paused",
    )  # fmt: skip

    #: Seconds a request head may take to arrive; 0 = no bound. See `bounded_head_protocol`.
    head_timeout_s: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes other than body the request being read may still take; None once refused.
        self._head_left: int | None = HEAD_LIMIT_BYTES
        # When the head being read began (loop time); None while no head is being read.
        self._head_since: float | None = None
        # No byte of a request has arrived yet on this connection.
        self._fresh = True
        # Requests read while another was in flight on this connection (pipelining), which
        # uvicorn no longer points to; None until there is one.
        self._earlier: list[RequestResponseCycle] | None = None
        # Bytes read while a request waits behind another, not yet parsed.
        self._held = b""
        self._releasing = False
        self.socket_paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _HoldingFlow(transport, self._resumed)
        self._head_since = self.loop.time()
        if self.server_state not in _sweeps:
            interval = min(SWEEP_S, self.head_timeout_s / 4) if self.head_timeout_s else SWEEP_S
            _sweeps[self.server_state] = self.loop.call_later(
                interval, _sweep, self.loop, self.server_state, interval
            )

    def connection_lost(self, exc: Exception | None) -> None:
        # uvicorn tells only the newest request; an older one may be waiting for a slot.
        for cycle in self._earlier or ():
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        self._held = b""
        super().connection_lost(exc)
        # Then each request still in flight that watches is told, the newest last.
        for cycle in self._earlier or ():
            _tell_gone(cycle)
        if self.cycle is not None:
            _tell_gone(self.cycle)

    def data_received(self, data: bytes) -> None:
        if self._head_left is None:
            return  # refused: what still arrives is dropped until the close
        if self.flow.read_paused or self._held:
            self._hold(data)
            return
        self._parse(data)

    # -- parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._head_since = self.loop.time()
        self._fresh = False
        _uvicorn_on_message_begin(self)

    def on_headers_complete(self) -> None:
        self._head_since = None
        if self.parser.should_upgrade():
            self._refuse(
                UpgradeRefused(
                    "slotgate does not switch protocols (Upgrade, CONNECT); send the request "
                    "as plain HTTP/1.1, without Upgrade"
                )
            )
            return
        previous = self.cycle
        # uvicorn builds the request's cycle here, by the name its module holds: for this call
        # the name is slotgate's Cycle, so the cycle is one from the start. (Swapping its class
        # afterwards cost a dict per cycle and made every attribute site of uvicorn's that it
        # reaches see two classes, which Python 3.11 then looks up the generic way: about 40
        # lookups per request.) Nothing else runs on the loop meanwhile.
        _uvicorn_names["RequestResponseCycle"] = Cycle
        try:
            _uvicorn_on_headers_complete(self)
        finally:
            _uvicorn_names["RequestResponseCycle"] = RequestResponseCycle
        # Its loop, for the request's watch to find its task by without asking asyncio for the
        # running loop (on Python 3.11 a getpid system call).
        self.cycle.loop = self.loop  # type: ignore[attr-defined]  # a Cycle: made just above
        if previous is not None and not previous.response_complete:
            earlier = [c for c in self._earlier or () if not c.response_complete]
            earlier.append(previous)
            self._earlier = earlier

    def on_body(self, body: bytes) -> None:
        if self._head_left is None:
            return
        self._head_left += len(body)
        _uvicorn_on_body(self, body)

    def on_message_complete(self) -> None:
        if self._head_left is None:
            return
        self._head_left = HEAD_LIMIT_BYTES
        _uvicorn_on_message_complete(self)

    def on_response_complete(self) -> None:
        # A head begun behind the request just answered gets its full time from now.
        if self._head_since is not None:
            self._head_since = self.loop.time()
        if self._earlier is not None:
            self._earlier = [c for c in self._earlier if not c.response_complete] or None
        _uvicorn_on_response_complete(self)

    # -- uvicorn's own answers, in the API's shape ----------------------------------------------

    def send_400_response(self, msg: str) -> None:
        self._refuse(BadRequest("the request is not valid HTTP/1.1; slotgate could not parse it"))

    # -- uvicorn's upgrade handling, replaced by the 400 above -----------------------------------

    def _should_upgrade(self) -> bool:
        return False

    def _unsupported_upgrade_warning(self) -> None:
        pass

    # -- the sweep -------------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Answer 408 if the head being read is past HEAD_TIMEOUT_S (called by the sweep)."""
        since = self._head_since
        if (
            since is None
            or not self.head_timeout_s
            or now - since <= self.head_timeout_s
            or self._head_left is None
            or self._busy()
        ):
            return
        if self._fresh:
            # Nothing was asked: closed as uvicorn closes an idle keep-alive connection.
            self._head_left = None
            self.transport.close()
            return
        self._refuse(
            HeadTimeout(
                f"request head not complete after {self.head_timeout_s:g} s (HEAD_TIMEOUT_S); "
                "send the whole head at once"
            )
        )

    # -- internals -------------------------------------------------------------------------------

    def _parse(self, data: bytes) -> None:
        _uvicorn_data_received(self, data)
        if self._head_left is None or self.transport.is_closing():
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

    def _resumed(self) -> None:
        if self._held and not self._releasing:
            # Not from inside uvicorn's call (a receive(), a response's end): parse on the next
            # turn of the loop, as if the bytes had just arrived.
            self._releasing = True
            self.loop.call_soon(self._release)
        elif self.socket_paused:
            self.socket_paused = False
            self.transport.resume_reading()

    def _release(self) -> None:
        self._releasing = False
        if self.flow.read_paused or self.transport.is_closing() or self._head_left is None:
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
        self._head_left = None
        self._held = b""
        if (
            self.cycle is not None
            and self.cycle.response_started
            and not self.cycle.response_complete
        ):
            # An answer now would land inside the response being written: close instead.
            self.transport.close()
            return
        status, headers, body = render(refusal(exc), "openai")
        # The request id the relay would have given it: the client's own when it came (and
        # is valid), else a new one.
        headers += id_headers(request_id({"headers": getattr(self, "headers", None) or ()}))
        head = b"".join(b"%s: %s\r\n" % header for header in headers)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\n%sconnection: close\r\n\r\n%s"
            % (status, _REASONS.get(status, b""), head, body)
        )
        if self.socket_paused:
            self.socket_paused = False
            self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)


def watch_disconnect(receive: Receive, gone: Callable[[], None]) -> Cycle | None:
    """Call `gone` once if the client of the request `receive` belongs to disconnects before
    its answer is complete: when uvicorn's `receive()` would answer `http.disconnect`. The
    request's cycle, returned, holds `gone` until its `gone` is set to None (the watch's end).

    None when `receive` is not a request of this protocol's (another server, or a test
    driving the app with its own), or when its client is gone already: then a pending
    `receive()` tells.
    """
    # uvicorn hands the app its cycle's bound `receive`; this protocol alone makes `Cycle`s.
    cycle = getattr(receive, "__self__", None)
    if not isinstance(cycle, Cycle) or cycle.loop is None or cycle.disconnected:
        return None
    cycle.gone = gone
    return cycle


def _tell_gone(cycle: RequestResponseCycle) -> None:
    """The connection ended: call the watch of a request it cut short, once."""
    if isinstance(cycle, Cycle) and cycle.disconnected:
        gone, cycle.gone = cycle.gone, None
        if gone is not None:
            gone()


class _HoldingFlow(FlowControl):
    """uvicorn's flow control, except that a pause of reading holds the bytes (the protocol
    does) instead of leaving them in the kernel, where a client's FIN or reset stays unseen."""

    def __init__(self, transport: asyncio.Transport, on_resume: Callable[[], None]) -> None:
        super().__init__(transport)
        self._on_resume = on_resume

    def pause_reading(self) -> None:
        self.read_paused = True

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._on_resume()


def bounded_head_protocol(head_timeout_s: float) -> type[BoundedHeadProtocol]:
    """The protocol class to give uvicorn, with HEAD_TIMEOUT_S set."""
    return type("SlotgateProtocol", (BoundedHeadProtocol,), {"head_timeout_s": head_timeout_s})


def _sweep(loop: asyncio.AbstractEventLoop, state: ServerState, interval: float) -> None:
    now = loop.time()
    paused: dict[int, BoundedHeadProtocol] = {}
    for connection in list(state.connections):
        if isinstance(connection, BoundedHeadProtocol):
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
