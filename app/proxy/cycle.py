"""One request's exchange on a connection of slotgate's protocol (app/proxy/protocol.py): its
scope, the body it reads (`receive`), the answer it writes (`send`), and the app's run.

It keeps uvicorn's `RequestResponseCycle` contract, which the tests hold it to byte for byte:
the same status lines and default headers first, the same framing decisions (a length, chunks,
or neither for HEAD, 204 and 304), the same checks against response splitting, the same
errors for an answer longer or shorter than its head said, 100-continue on the first
`receive`, and a 500 for an app that fails before its answer starts. It is slotgate's own
class, not a subclass of uvicorn's, so that it can be compiled with its attributes in a C
struct (a compiled class over an interpreted base keeps the base's attributes in a dict that
Python 3.11 looks up the generic way; bench/README.md).

Cheaper than uvicorn's in what every request pays for:
- The head: uvicorn checks each header's name and value with a regular expression of its own,
  lowercases each name into a new string and builds a list per header. `_head_bytes` makes
  the same two checks once over all the names and once over all the values: a character class
  matches in the joined bytes exactly where it matches in one of them (and a byte of it is in
  them exactly when deleting its class's bytes shortens them).
- No second check of headers already checked: a head whose message says `CHECKED_HEADERS`
  (every head slotgate's Answer sends, app/proxy/answer.py) skips the two.
- One write: a head sent with `BODY_FOLLOWS` (app/proxy/answer.py) is held and goes out with
  the body's first bytes, in one system call, where uvicorn writes each the moment it is sent.
  Whatever ends a send without writing (an error, a cancellation while the socket drains) lets
  the held head out first, unless the client has gone: the head never waits past the next send,
  which the app makes at once.
- The body read: no `asyncio.Event` per request; a future is made only when `receive` must
  wait (a body still arriving), and a body that came in one piece is handed over as it came
  (one in many pieces is gathered in a buffer past the first few, as uvicorn gathers it).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slotgate.asgi import Message, Receive, Scope, Send
from slotgate.proxy.answer import BODY_FOLLOWS, CHECKED_HEADERS
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

if TYPE_CHECKING:
    from slotgate.proxy.protocol import Connection

log = logging.getLogger("uvicorn.error")

App = Callable[[Scope, Receive, Send], Any]


def _refused_by(pattern: re.Pattern[bytes]) -> bytes:
    """The bytes that uvicorn's character class `pattern` matches."""
    return bytes(byte for byte in range(256) if pattern.match(bytes([byte])))


# uvicorn's checks against response splitting, as the bytes they refuse: deleting them from
# the joined names (values) and comparing lengths costs a third of the regular expression's
# search.
_NAME_REFUSED = _refused_by(HEADER_RE)
_VALUE_REFUSED = _refused_by(HEADER_VALUE_RE)
_NAME, _VALUE = operator.itemgetter(0), operator.itemgetter(1)
#: The names whose values decide the answer's framing or its connection's end.
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Pieces of a body kept as they came before `receive` takes them; what follows is gathered in
#: one buffer, as uvicorn gathers a body: a body sent in tiny chunks would otherwise cost an
#: object per chunk, some fifty bytes for each two of body.
_PIECES = 8
_SERVER_ERROR: Message = {
    "type": "http.response.start",
    "status": 500,
    "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", b"21"),
        (b"connection", b"close"),
    ],
}


class Cycle:
    """One request on a connection, from its head to the end of its answer."""

    def __init__(
        self,
        connection: Connection,
        scope: Scope,
        keep_alive: bool,
        expect_100_continue: bool,
    ) -> None:
        self.scope = scope
        #: The connection's, read once: what the answer is written to.
        self.transport: asyncio.Transport = connection.transport
        self.loop: asyncio.AbstractEventLoop = connection.loop
        self.default_headers: list[tuple[bytes, bytes]] = connection.server_state.default_headers
        # The connection, told when the answer is complete; None once the app has returned,
        # so that a request kept by someone does not keep its connection.
        self._connection: Connection | None = connection
        # Connection state.
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        # Request state: the body's pieces not yet received (the first _PIECES as they came,
        # the rest gathered), and whether more will come.
        self._pieces: list[bytes] = []
        self._rest: bytearray | None = None
        self.body_size = 0
        self.more_body = True
        # Something for `receive` to see (body, the body's end, the request's end), and the
        # future a waiting `receive` sleeps on; those of any other `receive` waiting at once
        # (ASGI allows it, and uvicorn wakes them all), None while there is none.
        self.ready = False
        self._waiter: asyncio.Future[None] | None = None
        self._others: list[asyncio.Future[None]] | None = None
        # Response state.
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding: bool | None = None
        self.expected_content_length = 0
        # The held head (BODY_FOLLOWS), until the body's first write.
        self._head: bytes | None = None
        #: What the connection calls if it ends before this answer does (the request's watch,
        #: app/proxy/watch.py); None while nothing watches.
        self.gone: Callable[[], None] | None = None
        #: The task the app runs in, set as it is made (the request's watch cancels it).
        self.task: asyncio.Task[None] | None = None

    # -- what the connection tells ----------------------------------------------------------------

    def take_body(self, piece: bytes) -> None:
        """A piece of the request's body arrived."""
        self.body_size += len(piece)
        rest = self._rest
        if rest is not None:
            rest.extend(piece)
        elif len(self._pieces) < _PIECES:
            self._pieces.append(piece)
        else:
            self._rest = bytearray(piece)
        self.wake()

    def wake(self) -> None:
        """There is something for `receive` to see."""
        self.ready = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        others = self._others
        if others is not None:
            for other in others:
                if not other.done():
                    other.set_result(None)

    # -- the app's run ----------------------------------------------------------------------------

    async def run_asgi(self, app: App) -> None:
        """Run the app for this request, as uvicorn's cycle does: a 500 if it fails (or returns)
        before its answer starts, the connection closed if it fails in the middle."""
        try:
            result = await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            log.exception("Exception in ASGI application\n", exc_info=exc)
            if not self.response_started:
                await self._send_500()
            else:
                self._let_head_out()
                self.transport.close()
        else:
            if result is not None:
                log.error("ASGI callable should return None, but returned '%s'.", result)
                self._let_head_out()
                self.transport.close()
            elif not self.response_started and not self.disconnected:
                log.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                log.error("ASGI callable returned without completing response.")
                self._let_head_out()
                self.transport.close()
        finally:
            self._connection = None

    async def _send_500(self) -> None:
        await self.send(_SERVER_ERROR)
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    # -- ASGI -------------------------------------------------------------------------------------

    async def receive(self) -> Message:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            connection = self._connection
            if connection is not None and connection.read_paused:
                connection.resume_reading()
            if not self.ready:
                if self._waiter is None:
                    waiter = self._waiter = self.loop.create_future()
                    try:
                        await waiter
                    finally:
                        self._waiter = None
                else:
                    await self._wait_beside()
            self.ready = False
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        pieces = self._pieces
        # One piece (the usual small body) is handed over as it came: join returns it.
        body = b"".join(pieces) if pieces else b""
        if pieces:
            self._pieces = []
            self.body_size = 0
            rest = self._rest
            if rest is not None:
                self._rest = None
                body = b"".join((body, rest))
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def _wait_beside(self) -> None:
        """Wait as another `receive` waits already, until there is something to see."""
        others = self._others
        if others is None:
            others = self._others = []
        waiter = self.loop.create_future()
        others.append(waiter)
        try:
            await waiter
        finally:
            others.remove(waiter)

    async def send(self, message: Message) -> None:
        connection = self._connection
        if connection is not None and connection.write_paused and not self.disconnected:
            try:
                await connection.drain()
            except BaseException:
                self._let_head_out()
                raise
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
                )
            head = self._head_bytes(message)
            if message.get(BODY_FOLLOWS):
                self._head = head
            else:
                self.transport.write(head)
            return
        if self.response_complete:
            raise RuntimeError(
                f"Unexpected ASGI message '{message['type']}' sent, after response already "
                "completed."
            )
        try:
            content = self._body_bytes(message)
        except BaseException:
            self._let_head_out()
            raise
        held = self._head
        if held is not None:
            self._head = None
            content = held + content
        if content:
            self.transport.write(content)
        if not message.get("more_body", False):
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.wake()
            if not self.keep_alive:
                self.transport.close()
            if connection is not None:
                connection.on_response_complete()

    # -- the answer's bytes -----------------------------------------------------------------------

    def _let_head_out(self) -> None:
        """Write the held head, if any, unless the client has gone."""
        head, self._head = self._head, None
        if head is not None and not self.disconnected:
            self.transport.write(head)

    def _body_bytes(self, message: Message) -> bytes:
        """What a body message puts on the wire, its framing counted as uvicorn counts it."""
        if message["type"] != "http.response.body":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
            )
        body: bytes = message.get("body", b"")
        if self.scope["method"] == "HEAD":
            self.expected_content_length = 0
            return b""
        if self.chunked_encoding:
            more_body: bool = message.get("more_body", False)
            if body:
                framed = b"%x\r\n%s\r\n" % (len(body), body)
                return framed if more_body else framed + b"0\r\n\r\n"
            return b"" if more_body else b"0\r\n\r\n"
        size = len(body)
        if size > self.expected_content_length:
            raise RuntimeError("Response content longer than Content-Length")
        self.expected_content_length -= size
        return body

    def _head_bytes(self, message: Message) -> bytes:
        """The head of the answer `message` starts, as uvicorn's `send` builds it, its state
        (keep-alive, framing, the length expected) set as uvicorn sets it."""
        self.response_started = True
        self.waiting_for_100_continue = False
        status: int = message["status"]
        headers: list[tuple[bytes, bytes]] = [*self.default_headers, *message.get("headers", ())]
        # The default headers are the date uvicorn formats (slotgate configures no others).
        if not message.get(CHECKED_HEADERS):
            # map and itemgetter: no list comprehension's frame (a call each on Python 3.11).
            names = b"".join(map(_NAME, headers))
            if len(names.translate(None, _NAME_REFUSED)) != len(names):
                raise RuntimeError("Invalid HTTP header name.")
            values = b"".join(map(_VALUE, headers))
            if len(values.translate(None, _VALUE_REFUSED)) != len(values):
                raise RuntimeError("Invalid HTTP header value.")
        content = [STATUS_LINE[status]]
        close = False
        for name, value in headers:
            if not name.islower():
                name = name.lower()
            if name not in _FRAMING:
                # Appended one by one: compiled, an append is a fifth of a tuple's concatenation.
                content.append(name)
                content.append(b": ")
                content.append(value)
                content.append(b"\r\n")
                continue
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [
                token.lower().strip() for token in value.split(b",")
            ]:
                self.keep_alive = False
                close = True
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not close:
            content.append(b"connection: close\r\n")
        if (
            self.chunked_encoding is None
            and self.scope["method"] != "HEAD"
            and status not in (204, 304)
        ):
            # Neither content-length nor transfer-encoding specified.
            self.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        return b"".join(content)
