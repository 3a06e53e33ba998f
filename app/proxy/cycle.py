"""One request's cycle on a connection of slotgate's protocol (app/proxy/protocol.py):
uvicorn's `RequestResponseCycle`, with the answer's head built by slotgate and a whole answer
written in one system call."""

from __future__ import annotations

import asyncio
import logging
import operator
import re
from collections.abc import Callable
from typing import Any

from slotgate.asgi import Message
from slotgate.proxy.answer import BODY_FOLLOWS
from uvicorn._types import HTTPScope
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)


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


_uvicorn_init = RequestResponseCycle.__init__


class Cycle(RequestResponseCycle):
    """uvicorn's request cycle, with a cheaper head, and a whole answer's head and body written
    in one system call.

    The head. uvicorn checks each header's name and value with a regular expression of its
    own, lowercases each name into a new string and builds a list per header: for the six or
    so headers of an answer, about a hundred allocations, more than any other step of a
    relayed request. `_head_bytes` builds the same head (uvicorn's status lines, its framing
    decisions, its default headers first) and makes the same two checks, each once over all
    the names and once over all the values: a character class matches in the joined bytes
    exactly where it matches in one of them (and a byte of it is in them exactly when deleting
    its class's bytes shortens them).

    One write. uvicorn writes the head the moment the app sends it: for a non-streamed
    answer, one write for the head and one for the body, each a trip through the kernel's TCP
    stack. A head sent with `BODY_FOLLOWS` (app/proxy/answer.py) is held, and goes out with
    the body: a whole body of the length the head said is written with it and the answer
    ended as uvicorn ends one; any other body goes through uvicorn's `send`, which writes the
    head first, whatever it does to the transport (close it) lets the head out first, and a
    send that ends without writing (cancelled while uvicorn waits for the socket to drain, or
    refused) lets it out too, unless the client has gone: the head never waits past the next
    send, which the app makes at once.
    """

    def __init__(
        self,
        scope: HTTPScope,
        transport: asyncio.Transport,
        flow: FlowControl,
        logger: logging.Logger,
        access_logger: logging.Logger,
        access_log: bool,
        default_headers: list[tuple[bytes, bytes]],
        message_event: asyncio.Event,
        expect_100_continue: bool,
        keep_alive: bool,
        on_response: Callable[..., None],
    ) -> None:
        # uvicorn's own, its arguments passed on by position: uvicorn makes the cycle with
        # keywords, and a `**kwargs` passed on would build and unpack a dict per request.
        _uvicorn_init(
            self, scope, transport, flow, logger, access_logger, access_log, default_headers,
            message_event, expect_100_continue, keep_alive, on_response,
        )  # fmt: skip
        # The held head, on the instance: a class default would make Python 3.11 look every
        # read of it up the generic way.
        self._head: bytes | None = None
        #: The connection's loop, once its protocol (app/proxy/protocol.py) has made the cycle.
        self.loop: asyncio.AbstractEventLoop | None = None
        #: What the connection calls if it ends before this answer does (the request's watch,
        #: app/proxy/watch.py); None while nothing watches.
        self.gone: Callable[[], None] | None = None

    async def send(self, message: Message) -> None:  # type: ignore[override]
        head = self._head
        if head is None:
            if self.response_started or message["type"] != "http.response.start" or self.access_log:
                await super().send(message)  # type: ignore[arg-type]
                return
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            head = self._head_bytes(message)
            if message.get(BODY_FOLLOWS):
                self._head = head
            else:
                self.transport.write(head)
            return
        if self.flow.write_paused and not self.disconnected:
            # Waited for here, as uvicorn would: then nothing waits while the transport is
            # swapped, so no timer or cancellation finds the swap.
            await self.flow.drain()
        self._head = None
        if (
            message["type"] == "http.response.body"
            and not message.get("more_body", False)
            and not self.disconnected
            and self.chunked_encoding is False
            and self.scope["method"] != "HEAD"
            and len(body := message.get("body", b"")) == self.expected_content_length
        ):
            # The whole answer, ended as uvicorn's `send` ends one, its head and body in one
            # write. (Through uvicorn's `send` with the transport swapped, as below, it costs
            # a request more: the swap makes uvicorn's writes see two kinds of transport.)
            self.transport.write(head + body)
            self.expected_content_length = 0
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self.transport.close()
            # Read, then called: uvicorn's callback is an attribute, and called as a method
            # Python 3.11 would look it up the generic way.
            on_response = self.on_response
            on_response()
            return
        transport = self.transport
        joined = _Joined(transport, head)
        self.transport = joined  # type: ignore[assignment]
        try:
            await super().send(message)  # type: ignore[arg-type]
        finally:
            self.transport = transport
            if joined.head is not None and not self.disconnected:
                transport.write(joined.head)

    def _head_bytes(self, message: Message) -> bytes:
        """The head of the answer `message` starts, as uvicorn's `send` builds it, its state
        (keep-alive, framing, the length expected) set as uvicorn sets it."""
        self.response_started = True
        self.waiting_for_100_continue = False
        status: int = message["status"]
        headers = [*self.default_headers, *message.get("headers", ())]
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
                content += (name, b": ", value, b"\r\n")
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


class _Joined:
    """What a `Cycle` writes through while it sends the body after a held head: the first
    write goes out after the head, in one system call; any other use of the transport (a
    close) lets the head out first."""

    __slots__ = ("head", "transport")

    def __init__(self, transport: asyncio.Transport, head: bytes) -> None:
        self.transport = transport
        self.head: bytes | None = head

    def write(self, data: bytes) -> None:
        head = self.head
        if head is None:
            self.transport.write(data)
            return
        self.head = None
        self.transport.write(head + data)

    def __getattr__(self, name: str) -> Any:
        head, self.head = self.head, None
        if head is not None:
            self.transport.write(head)
        return getattr(self.transport, name)
