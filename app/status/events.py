"""`GET /admission/events`: the admission snapshot as server-sent events, one a tick.

One ticker for every watcher: while anybody watches, it builds one snapshot a tick and wakes
them all with the same bytes; while nobody does, it does not run, and nothing is built. A
watcher too slow to take every snapshot gets the newest when it is ready (nothing piles up for
it). At most `limit` watch at once (STATUS_WATCHERS); one more is refused (`TooManyWatchers`,
429 with Retry-After). Every stream ends when its client leaves, and all of them at once when
the gate drains (`close`), so that a watcher never holds up a shutdown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from slotgate.asgi import Receive, Scope, Send
from slotgate.errors import TooManyWatchers
from starlette.responses import Response

#: Sent first: how long a browser's EventSource waits before it reconnects, in ms.
RETRY = b"retry: 2000\n\n"
_HEAD = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    # Tells nginx not to buffer the stream (docs/operating.md).
    (b"x-accel-buffering", b"no"),
]


class _Watcher:
    __slots__ = ("gone", "wake")

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.gone = False


class Events:
    """The watchers of one app and the one ticker that feeds them."""

    def __init__(self, build: Callable[[], bytes], limit: int, tick_s: float = 1.0) -> None:
        self._build = build
        self.limit = limit
        self._tick_s = tick_s
        self._watchers: set[_Watcher] = set()
        # Streams answered and not yet ended: counted from the answer, so that no two
        # requests between their check and their start go past the limit.
        self._count = 0
        self._frame = b""
        self._ticker: asyncio.Task[None] | None = None
        self._closed = False
        #: Snapshots built since start (nothing is built while nobody watches).
        self.built = 0

    @property
    def watchers(self) -> int:
        return self._count

    @property
    def running(self) -> bool:
        """The ticker runs (it stops within a tick of the last watcher leaving)."""
        return self._ticker is not None

    def stream(self, headers: list[tuple[bytes, bytes]]) -> Response:
        """A new watcher's answer (with `headers` besides its own); raises TooManyWatchers
        past the limit."""
        if self._count >= self.limit:
            raise TooManyWatchers(
                f"{self._count} clients already watch /admission/events "
                f"(STATUS_WATCHERS={self.limit}); close one, or poll GET /admission instead"
            )
        self._count += 1
        return _Stream(self, headers)

    async def watch(self, receive: Receive, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        watcher = _Watcher()
        self._watchers.add(watcher)
        listener = asyncio.ensure_future(_until_gone(receive, watcher))
        try:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [*_HEAD, *headers]}
            )
            await send({"type": "http.response.body", "body": RETRY, "more_body": True})
            if self._ticker is None and not self._closed:
                self._frame = self._next()
                self._ticker = asyncio.create_task(self._run(), name="slotgate-status-events")
            while not (self._closed or watcher.gone):
                watcher.wake.clear()
                await send({"type": "http.response.body", "body": self._frame, "more_body": True})
                await watcher.wake.wait()
            if not watcher.gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._count -= 1
            self._watchers.discard(watcher)
            listener.cancel()

    async def _run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._tick_s)
                if not self._watchers or self._closed:
                    return
                self._frame = self._next()
                for watcher in self._watchers:
                    watcher.wake.set()
        finally:
            self._ticker = None

    def _next(self) -> bytes:
        self.built += 1
        return b"data: " + self._build() + b"\n\n"

    def close(self) -> None:
        """The gate drains: every stream ends now, and no new one starts."""
        self._closed = True
        for watcher in self._watchers:
            watcher.wake.set()
        if self._ticker is not None:
            self._ticker.cancel()


async def _until_gone(receive: Receive, watcher: _Watcher) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    watcher.gone = True
    watcher.wake.set()


class _Stream(Response):
    """The event stream as a route's answer: FastAPI calls it with the request's channels."""

    def __init__(self, events: Events, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__()
        self._events = events
        self._extra = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._events.watch(receive, send, self._extra)
