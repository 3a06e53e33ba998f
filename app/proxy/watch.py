"""A request's cancellation, handled in one place: its client leaving, an operator cancelling
it, or the drain timeout running out at shutdown.

`Watch` is an async scope around whatever a request does while its client may leave (wait for
a slot, forward, relay). It cancels the request's task the moment the client disconnects, or
when an operator asks (`Running.cancel`), and on the way out it tells the cancellations apart:
the client leaving ends the request as `client_gone`; an operator's ends it as `cancelled`,
its slot given back before its client is told; one from outside (the drain timeout) is told
to the client while its answer can still carry an error, and otherwise goes on up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from types import TracebackType

from slotgate.asgi import Headers, Message, Receive
from slotgate.errors import Cancelled, Refusal, refusal
from slotgate.outcome import Outcome
from slotgate.proxy.answer import Answer
from slotgate.proxy.protocol import watch_disconnect
from slotgate.proxy.request import Request

#: How long a request runs before slotgate starts watching for its client to leave, when the
#: connection cannot say so itself (another ASGI server than slotgate's own protocol).
WATCH_AFTER_S = 0.02
#: The answer of a request an operator cancelled.
_CANCELLED = refusal(
    Cancelled("an operator cancelled this request; it was not completed, do not resend it as is")
)


class Running(dict[str, "Watch"]):
    """The requests an operator may cancel, by request id: each gated request from the moment
    its watch starts (its body read) until it ends. It is also where `/admission`'s waiting
    list is read from (app/status/waiting.py): one registry, so a request that waits costs
    nothing more than one admitted at once. A request id a client chose and
    sent on several requests at once names the newest of them still running: one that ends
    gives the id back to the one before it, so that a client reusing an id cannot make its
    longer request one nobody can cancel."""

    def __init__(self) -> None:
        super().__init__()
        #: The older requests running under an id sent on several, oldest first; only live
        #: ones (each leaves as it ends), and nothing at all while ids are not reused.
        self.older: dict[str, list[Watch]] = {}

    def enlist(self, request_id: str, watch: Watch) -> None:
        newest = self.get(request_id)
        if newest is not None:
            self.older.setdefault(request_id, []).append(newest)
        self[request_id] = watch

    def delist(self, request_id: str, watch: Watch) -> None:
        older = self.older.get(request_id)
        if self.get(request_id) is watch:
            if older:
                self[request_id] = older.pop()
            else:
                del self[request_id]
        elif older and watch in older:
            older.remove(watch)
        if older is not None and not older:
            del self.older[request_id]

    def watches(self) -> Iterator[Watch]:
        """Every request listed, those under a reused id included (oldest of those first)."""
        for request_id, watch in self.items():
            older = self.older.get(request_id)
            if older:
                yield from older
            yield watch

    def cancel(self, request_id: str) -> bool:
        """Cut the request, or take it out of the line; False when none runs by that id."""
        watch = self.get(request_id)
        return watch is not None and watch.cut()


class Watch:
    """Cancels the request's task the moment its client disconnects, or an operator cuts it.

    Under slotgate's own uvicorn protocol the connection says so when it ends
    (app/proxy/protocol.py's `watch_disconnect`), and the watch is on from the start.
    Elsewhere uvicorn, like any ASGI server, answers `receive()` with `http.disconnect` once
    the client is gone, so one pending `receive()`, as a task, learns of it while the request's
    own task is busy waiting for a slot or for llama-server. The task is cancelled rather than
    polled, so every `finally` on the way out (upstream close, slot release) runs at once.
    That pending `receive()` starts only after WATCH_AFTER_S: a request answered sooner never
    pays for it, and a client leaving in that time is noticed at most that much later.
    """

    __slots__ = (
        "_answer", "_cycle", "_listed", "_own", "_pending", "_receive", "_request",
        "_running", "_task", "_timer", "cancelled", "done", "gone",
    )  # fmt: skip

    def __init__(
        self,
        receive: Receive,
        request: Request,
        answer: Answer,
        own: Callable[[Request], Headers],
        running: Running | None = None,
    ) -> None:
        self._receive = receive
        self._request: Request | None = request
        self._answer: Answer | None = answer
        self._own = own
        self.gone = False
        #: An operator cancelled it (`cut`).
        self.cancelled = False
        self.done = False
        self._running = running
        self._listed: str | None = None
        if running is not None:
            # Listed at once for operators to cancel: a dict's set and delete cost less than
            # the timer that deferred it did. An id not running yet (nearly always) is set
            # here, without `enlist`'s call.
            listed = self._listed = request.id
            if listed in running:
                running.enlist(listed, self)
            else:
                running[listed] = self
        self._pending: asyncio.Future[Message] | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Under slotgate's protocol the watch is a callback the request's cycle holds, cheaper
        # than the timer that would defer it, so it starts at once; the cycle knows its task
        # (current_task() is interpreted code, and without a loop asks
        # asyncio.get_running_loop(), on Python 3.11 a getpid system call).
        cycle = self._cycle = watch_disconnect(receive, self._disconnected)
        if cycle is not None:
            self._task = cycle.task
            return
        task = self._task = asyncio.current_task()
        loop = task.get_loop() if task is not None else asyncio.get_running_loop()
        self._timer = loop.call_later(WATCH_AFTER_S, self._start)

    @property
    def request(self) -> Request | None:
        """The request it watches; None once it is over."""
        return self._request

    def _start(self) -> None:
        self._timer = None
        self._cycle = watch_disconnect(self._receive, self._disconnected)
        if self._cycle is None:
            self._pending = asyncio.ensure_future(self._receive())
            self._pending.add_done_callback(self._on_message)

    def _on_message(self, pending: asyncio.Future[Message]) -> None:
        if pending.cancelled() or pending.exception() is not None:
            return
        if pending.result().get("type") == "http.disconnect":
            self._disconnected()

    def _disconnected(self) -> None:
        if not self.done and self._task is not None:
            self.gone = True
            # An operator's cancel is under way already: a second one would count as one from
            # outside (`ours` says no: a shutdown), or cut its client being told why.
            if not self.cancelled:
                self._task.cancel(msg="client disconnected")

    def cut(self) -> bool:
        """An operator's cancel: the request's task is cancelled, as when its client leaves;
        False when it is over already."""
        if self.done or self.gone or self.cancelled or self._task is None:
            return False
        self.cancelled = True
        self._task.cancel(msg="cancelled by an operator")
        return True

    def ours(self) -> bool:
        """After a CancelledError: was it only this watch's doing (so it may end here)?"""
        return (
            (self.gone or self.cancelled) and self._task is not None and self._task.uncancel() == 0
        )

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        try:
            return exc is not None and await self.settle(exc)
        finally:
            self.close()

    def close(self) -> None:
        """The request's work is over (settled, or ended without an exception): stop watching."""
        self.done = True
        listed = self._listed
        if listed is not None:
            self._listed = None
            running = self._running
            if running is not None:
                # Its id was sent on no other request still running (nearly always): the
                # entry goes without `delist`'s call.
                if not running.older and running.get(listed) is self:
                    del running[listed]
                else:
                    running.delist(listed, self)
        # Each of these holds a bound method of this watch, and the watch holds it: a cycle
        # that would keep the watch, its task, the task's coroutine and context alive until a
        # garbage collection (one for every request, which at 32 connections made collections
        # cost a quarter of the throughput). Dropped here, they go by reference count.
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        cycle, self._cycle = self._cycle, None
        if cycle is not None:
            cycle.gone = None
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
        # Whatever still holds the watch (a timer's reference on its way out) must not hold
        # the request's body with it.
        self._request = self._answer = None

    async def settle(self, exc: BaseException) -> bool:
        """The request's work ended by `exc`: True (the cancellation ends here) when the client
        left, an operator cancelled it, or its client was told of the shutdown; the watch goes
        on watching until then, as the request did; `close` follows either way. The relay
        calls both itself rather than `async with`: two coroutines less for every request."""
        request, answer = self._request, self._answer
        if not isinstance(exc, asyncio.CancelledError) or request is None or answer is None:
            return False
        if self.ours():
            if self.cancelled:  # first, whether or not its client left since
                return await self._cancelled(request, answer)
            request.outcome = Outcome.CLIENT_GONE
            return True
        return await cut_short(request, answer, self._own, self._truncate)

    async def _cancelled(self, request: Request, answer: Answer) -> bool:
        """Cancelled by an operator: its slot (or its place) back at once, then the client told
        in the route's shape, an error event if its stream had begun; a plain answer whose
        head went out can only be left unfinished, which its client sees as a truncation."""
        request.outcome = Outcome.CANCELLED
        # Its upstream connection was closed on the way here (the relay's scope), so
        # llama-server has stopped; the slot is not held while the client is told.
        if request.ticket is not None:
            request.ticket.release()
        if answer.started and not answer.stream and not answer.ending:
            self._truncate()
            return True
        await answer.final_words(_CANCELLED, request.flavor, self._own(request))
        return True

    def _truncate(self) -> bool:
        """Close the connection of a plain answer cut after its head (its client sees the
        truncation) without uvicorn logging it as an app's error; False where the connection
        is not slotgate's own protocol's, and uvicorn ends it its own way."""
        cycle = self._cycle
        if cycle is None:
            return False
        # Marked disconnected first, as losing the connection would mark it, so that uvicorn
        # takes the answer for one whose client left, not for one its app failed to complete
        # (an error in its log for every such cut).
        cycle.disconnected = True
        cycle.transport.close()
        return True


async def cut_short(
    request: Request,
    answer: Answer,
    own: Callable[[Request], Headers],
    truncate: Callable[[], bool] = lambda: False,
) -> bool:
    """Cancelled from outside: the drain timeout ran out at shutdown. Tell the client while its
    answer can still carry an error; True when it was told.

    Then the task may end normally, as uvicorn's shutdown wants, rather than log an error with
    a traceback for every request the drain timeout cut. A plain answer whose head went out can
    only be left unfinished, which the client sees as a truncation: `truncate` closes its
    connection (False where it cannot, and the cancellation goes on up).
    """
    message = "slotgate shut down before this request finished"
    cut = Refusal(503, "unavailable_error", "shutting_down", message, "internal")
    if answer.ending:
        # Whole but for its last send: end it as meant (final_words only sends the end again);
        # the client was served.
        await answer.final_words(cut, request.flavor, [])
        return True
    if answer.started and not answer.stream:
        if not truncate():
            return False
        request.outcome = Outcome.SHUTDOWN
        return True
    request.outcome = Outcome.SHUTDOWN
    await answer.final_words(cut, request.flavor, own(request))
    return True
