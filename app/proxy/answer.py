"""The answer to one request: the only code that calls ASGI `send` on the request path.

It owns the status, the bytes out, whether the head (and an event-stream head) went out, and
the tail of the relayed stream, as uvicorn's RequestResponseCycle owns `response_started`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from slotgate.asgi import Headers, Message, Send
from slotgate.errors import AnswerStarted, Flavor, Refusal
from slotgate.proxy.quota import Tally
from slotgate.proxy.refusals import render, stream_event

log = logging.getLogger("slotgate.relay")

_START = "http.response.start"
_BODY = "http.response.body"
#: A key of slotgate's own in a head's message: the whole body follows in the next send, with
#: nothing awaited in between. slotgate's protocol (app/proxy/protocol.py) then writes both in
#: one system call; any other server ignores the key.
BODY_FOLLOWS = "slotgate.body_follows"
#: A key of slotgate's own in a head's message: its headers need not be checked against
#: response splitting again. Every head this class sends has it: its headers are llama-server's
#: as httptools parsed them (its tables refuse every byte uvicorn's checks refuse; the tests
#: fuzz that), slotgate's constants and numbers, and the request id and Origin as checked on
#: the way in. slotgate's protocol (app/proxy/protocol.py) then skips the checks; any other
#: server ignores the key.
CHECKED_HEADERS = "slotgate.checked_headers"


class Answer:
    """What goes back to one client, written through `send` in order: a head, then a body."""

    __slots__ = (
        "_ending", "_send", "_tail", "bytes_out", "ended", "extra", "started", "status",
        "stream", "tally",
    )  # fmt: skip

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0
        self.bytes_out = 0
        self.started = False
        #: The head went out as an event stream's: whatever fails now is an in-stream event.
        self.stream = False
        #: The end went out (its send returned).
        self.ended = False
        # The end's body while its send is under way: a send cut there (uvicorn waits for the
        # client's socket to drain before it writes) may have written nothing.
        self._ending: bytes | None = None
        # The last bytes relayed into a stream: did they end an event?
        self._tail = b"\n\n"
        #: Headers every head carries besides its own: a tenant's rate limits (app/proxy/quota.py).
        self.extra: Headers | None = None
        #: Reads the tokens of what is relayed, for a tenant with a token quota.
        self.tally: Tally | None = None

    @property
    def ending(self) -> bool:
        """Its end is on its way out: the whole answer is written, the last send not done."""
        return self._ending is not None and not self.ended

    # -- the head ------------------------------------------------------------------------------

    async def start(
        self, status: int, headers: Headers, *, stream: bool = False, whole: bool = False
    ) -> None:
        """The head; `whole`: the caller sends the end next, at once (`BODY_FOLLOWS`)."""
        message = {
            "type": _START, "status": status, "headers": self._head(status, headers, stream),
            CHECKED_HEADERS: True,
        }  # fmt: skip
        if whole:
            message[BODY_FOLLOWS] = True
        await self._send(message)

    def _head(self, status: int, headers: Headers, stream: bool) -> Headers:
        """The head's headers, the answer marked as started."""
        if self.started:
            raise AnswerStarted(f"the answer's head ({self.status}) went out already")
        self.started = True
        self.status = status
        self.stream = stream
        return headers if self.extra is None else headers + self.extra

    # -- the body ------------------------------------------------------------------------------

    def relay(self, chunk: bytes) -> Awaitable[None]:
        """Bytes relayed as they came, more to follow. (It hands back `send`'s awaitable rather
        than awaiting it: this runs once per relayed chunk, and a coroutine of its own would
        add a frame to each.)"""
        self.bytes_out += len(chunk)
        self._tail = chunk
        if self.tally is not None:
            self.tally.feed(chunk)
        send = self._send  # as in `whole`
        return send({"type": _BODY, "body": chunk, "more_body": True})

    async def comment(self, comment: bytes) -> None:
        """slotgate's own keep-alive comment in a waiting stream (not counted as bytes out)."""
        await self._send({"type": _BODY, "body": comment, "more_body": True})

    async def event(self, event: bytes) -> None:
        """One event of slotgate's own into the stream, on an event boundary."""
        event = self._on_boundary(event)
        self.bytes_out += len(event)
        await self._send({"type": _BODY, "body": event, "more_body": True})

    async def end(self, body: bytes = b"") -> None:
        await self._send(self._last(body))
        self.ended = True

    def _last(self, body: bytes) -> Message:
        """The end's message, its body counted."""
        self._ending = body
        if self.tally is not None and body:
            self.tally.feed(body)
        self.bytes_out += len(body)
        return {"type": _BODY, "body": body, "more_body": False}

    async def whole(
        self, status: int, headers: Headers, body: bytes, *, stream: bool = False
    ) -> None:
        """A head and a body in one go: `start` and `end` without their two coroutines, which
        every non-streamed answer would pay for."""
        head = self._head(status, headers, stream)
        send = self._send  # read as an attribute: called as a method, 3.11 looks it up slowly
        await send(
            {
                "type": _START, "status": status, "headers": head, BODY_FOLLOWS: True,
                CHECKED_HEADERS: True,
            }
        )  # fmt: skip
        await send(self._last(body))
        self.ended = True

    # -- refusals ------------------------------------------------------------------------------

    async def refuse(self, r: Refusal, flavor: Flavor, own: Headers) -> None:
        """slotgate's own error: a whole answer, or an event ending a stream already begun."""
        if self.stream:
            await self.event(stream_event(r, flavor))
            await self.end()
            return
        status, headers, body = render(r, flavor)
        headers += own
        await self.whole(status, headers, body)

    async def final_words(self, r: Refusal, flavor: Flavor, own: Headers) -> None:
        """Best effort, during cancellation: end the answer with an error rather than silence.
        An answer whose end went out gets nothing more; one cut while its end was being sent
        is ended as it was meant to be, not with an error after its last byte."""
        if self.ended:
            return
        try:
            async with asyncio.timeout(1.0):
                if self._ending is not None:
                    await self._send({"type": _BODY, "body": self._ending, "more_body": False})
                    self.ended = True
                    return
                if self.stream:
                    body = self._on_boundary(stream_event(r, flavor))
                else:
                    status, headers, body = render(r, flavor)
                    headers += own
                    await self.start(status, headers, whole=True)
                self._ending = body
                self.bytes_out += len(body)
                await self._send({"type": _BODY, "body": body, "more_body": False})
                self.ended = True
        except (OSError, RuntimeError, TimeoutError):
            log.debug("could not tell a cancelled client why", exc_info=True)

    def _on_boundary(self, event: bytes) -> bytes:
        """The event, after a blank line if the bytes relayed last left an event unfinished (the
        upstream cut mid-event): glued on, it would become part of that event's last line."""
        if self._tail.endswith((b"\n\n", b"\r\n\r\n")):
            return event
        return b"\n\n" + event
