"""The admission core: a pool of llama-server slots and a bounded FIFO line in front of it.

Standard library only; it knows nothing of HTTP. One event loop owns an `Admission`: every
method runs on that loop, and the methods that change the pool (`enter`, `Ticket.release`,
`resize`) are synchronous, so no `await` can split a hand-off between two holders.

While the capacity is unknown (llama-server starting or restarting) the pool admits nobody,
but with a startup wait set it still takes requests into the line, up to the last known line
limit (the policy's floor before any), each for at most the startup wait: `resize` to a known
capacity then admits them in arrival order, as any release would.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: A Retry-After above this is useless: the OpenAI Python SDK does not honour one past 60 s
#: and gives up past 120 s, so the estimate is capped well below both.
RETRY_AFTER_CAP_S = 60.0
#: Until a hold has been observed or expected (`Admission.expect`), assume this one.
INITIAL_HOLD_S = 1.0
#: Weight of the newest observation in the moving average of slot hold times.
HOLD_EWMA_ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The pool as one consistent picture."""

    capacity: int | None
    active: int
    queued: int
    queue_limit: int | None
    #: The KV-cache budget in tokens (None: it does not bind), and what admitted requests hold.
    budget_tokens: int | None = None
    committed_tokens: int = 0

    @property
    def free(self) -> int:
        return max((self.capacity or 0) - self.active, 0)

    @property
    def free_tokens(self) -> int | None:
        if self.budget_tokens is None:
            return None
        return max(self.budget_tokens - self.committed_tokens, 0)


class AdmissionError(Exception):
    """A request was not admitted; `snapshot` shows the pool at that moment."""

    def __init__(self, snapshot: Snapshot, retry_after_s: float) -> None:
        super().__init__(snapshot, retry_after_s)
        self.snapshot = snapshot
        self.retry_after_s = retry_after_s


class NotReady(AdmissionError):
    """The pool's capacity is not known yet (llama-server down, loading or restarting)."""


class ShuttingDown(AdmissionError):
    """The gate is draining for shutdown and takes no new work."""


class QueueFull(AdmissionError):
    """The line is at its limit."""


class QueueTimeout(AdmissionError):
    """The request waited longer than the queue timeout."""


class TooLarge(AdmissionError):
    """The request needs more slots than the pool has, so it could never be admitted."""

    def __init__(self, snapshot: Snapshot, weight: int) -> None:
        super().__init__(snapshot, 0.0)
        self.weight = weight


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """How deep the line may grow for a given capacity; `None` fields mean "not set"."""

    max_queue: int | None = None
    queue_per_slot: int | None = None
    min_queue: int | None = None

    DEFAULT_PER_SLOT = 16
    DEFAULT_MIN = 64

    def unknown_limit(self) -> int | None:
        """The line limit before any capacity is known: MAX_QUEUE, else MIN_QUEUE (or its
        default), else unbounded when QUEUE_PER_SLOT=0."""
        if self.max_queue is not None:
            return self.max_queue or None
        if self.queue_per_slot == 0:
            return None
        return self.DEFAULT_MIN if self.min_queue is None else self.min_queue

    def limit(self, capacity: int) -> int | None:
        """The line limit in requests, or None for an unbounded line."""
        if self.max_queue is not None:
            return self.max_queue or None
        if self.queue_per_slot is None:
            floor = self.DEFAULT_MIN if self.min_queue is None else self.min_queue
            return max(self.DEFAULT_PER_SLOT * capacity, floor)
        if self.queue_per_slot == 0:
            return None
        # An explicit multiplier is taken as meant: the default floor does not apply to it.
        return max(self.queue_per_slot * capacity, self.min_queue or 0)


class Ticket:
    """One request's claim: a place in the line, then `weight` slots and `cost` tokens of the
    KV-cache budget until released. `async with ticket:` releases it on every way out; an
    earlier `release()` is fine (a second one does nothing)."""

    __slots__ = (
        "_admission", "_future", "_released", "admitted_at", "cost", "entered_at", "seq", "weight",
    )  # fmt: skip

    def __init__(
        self, admission: Admission, weight: int, seq: int, admitted: bool, cost: int = 0
    ) -> None:
        self._admission = admission
        self.weight = weight
        self.cost = cost
        self.seq = seq
        self.entered_at = time.monotonic()
        self.admitted_at: float | None = self.entered_at if admitted else None
        self._future: asyncio.Future[None] | None = None
        self._released = False

    @property
    def admitted(self) -> bool:
        return self.admitted_at is not None

    @property
    def granted(self) -> bool:
        """The slots are this ticket's, even if its waiter has not resumed yet."""
        if self.admitted_at is not None:
            return True
        future = self._future
        return (
            future is not None
            and future.done()
            and not future.cancelled()
            and (future.exception() is None)
        )

    @property
    def wait_s(self) -> float:
        return (self.admitted_at or time.monotonic()) - self.entered_at

    @property
    def position(self) -> int:
        """1-based place in the line (approximate after cancellations ahead); 0 once admitted."""
        if self.admitted:
            return 0
        return self._admission._position(self.seq)

    async def wait(self) -> None:
        """Wait for the slots; on any exit without them, leave the line at once."""
        if self.admitted:
            return
        admission = self._admission
        future = self._future
        assert future is not None  # noqa: S101 - set by Admission.enter for every waiter
        try:
            if admission._capacity is None and admission._startup_wait_s:
                await admission._until_known(self)
            if admission._queue_timeout_s is None:
                # No scope at all without QUEUE_TIMEOUT (the default): an idle timeout scope
                # costs more than the whole hand-off it would wrap.
                await future
            else:
                async with asyncio.timeout_at(admission._deadline(self.entered_at)):
                    await future
        except BaseException as exc:
            self.release()
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(admission.snapshot(), admission.retry_after_s(1)) from None
            raise
        if not self._released:
            self.admitted_at = time.monotonic()

    def recost(self, cost: int) -> None:
        """Reserve `cost` tokens of the budget instead (a better count came in), in line or
        admitted; a lower cost may let the line move at once."""
        if self._released:
            return
        admission = self._admission
        if admission._budget is not None:
            cost = min(cost, admission._budget)
        surcharge = admission._surcharge(self.seq)
        if self.granted:
            admission._committed += cost - self.cost - surcharge
        elif cost:
            admission._costs[self.seq] = cost
        else:
            admission._costs.pop(self.seq, None)
        self.cost = cost
        admission._dispatch()

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> bool:
        """Give the slots back, or the place in the line; calling it twice is harmless.

        True when the release handed slots to a waiter.
        """
        if self._released:
            return False
        self._released = True
        admission = self._admission
        if self.admitted_at is not None:
            admission._committed -= self.cost + admission._surcharge(self.seq)
            return admission._release(self.weight, time.monotonic() - self.admitted_at)
        future = self._future
        if future is None:
            return False
        if future.done() and not future.cancelled() and future.exception() is None:
            # Handed the slots while its waiter was giving up, before it could resume:
            # pass them on, or they leak.
            admission._committed -= self.cost + admission._surcharge(self.seq)
            return admission._release(self.weight, None)
        admission._costs.pop(self.seq, None)
        admission._surcharge(self.seq)
        # Refused by resize or close (an exception set) means already out of the count.
        counted = not future.done() or future.cancelled()
        future.cancel()
        admission._leave(counted)
        return False


class Admission:
    """A pool of `capacity` slots and a FIFO line; O(1) per enter, leave and release.

    The line is a deque of (arrival number, future, weight). A waiter that gives up is not
    searched for: its future is cancelled, it stops counting in `queued`, and `_dispatch`
    drops it when it reaches the head (most who give up are the newest and are dropped from
    the tail at once). When such leftovers outnumber the live waiters the line is rebuilt
    without them, so memory stays bounded and every operation is O(1) amortised, at a cost
    that does not grow with the depth (an OrderedDict's did, measured: 177 ns per insert and
    pop at depth 0, 213 ns at 10,000, against a deque's 50 ns at both).
    """

    def __init__(
        self,
        policy: QueuePolicy | None = None,
        capacity: int | None = None,
        queue_timeout_s: float | None = None,
        startup_wait_s: float | None = None,
    ) -> None:
        self._policy = policy or QueuePolicy()
        self._queue_timeout_s = queue_timeout_s or None
        # None or 0: refuse at once (NotReady) while the capacity is unknown.
        self._startup_wait_s = startup_wait_s or None
        self._capacity: int | None = None
        self._limit: int | None = self._policy.unknown_limit()
        # Waiters that entered while the capacity was unknown and are weighed once it is.
        self._unsized: dict[asyncio.Future[None], tuple[Ticket, Callable[[int], int]]] = {}
        self._known = asyncio.Event()
        self._awaiting_known = 0
        self._active = 0
        self._line: deque[tuple[int, asyncio.Future[None], int]] = deque()
        self._waiting = 0  # the live entries of _line
        self._next_seq = 0
        self._hold_ewma_s = INITIAL_HOLD_S
        self._expected = 0  # holds expected so far; -1 once a real one has been observed
        self._closed = False
        self.admitted_total = 0
        # The KV-cache budget: None while it does not bind. The tokens each waiter will take
        # are kept beside the line, by arrival number, so the line's entries stay as they are.
        self._budget: int | None = None
        self._committed = 0
        self._costs: dict[int, int] = {}
        # Waiters in line when a budget first binds came at no cost: what they take is unknown,
        # so each is charged all of it (`resize_budget`), beside its ticket's own cost of 0.
        self._surcharged: dict[int, int] = {}
        if capacity is not None:
            self.resize(capacity)

    # -- reading -----------------------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def active(self) -> int:
        return self._active

    @property
    def queued(self) -> int:
        return self._waiting

    @property
    def queue_limit(self) -> int | None:
        return self._limit

    @property
    def awaiting_capacity(self) -> bool:
        """Somebody waits for the capacity to become known (so it is worth reading often)."""
        return self._capacity is None and (self._waiting > 0 or self._awaiting_known > 0)

    @property
    def hold_estimate_s(self) -> float:
        return self._hold_ewma_s

    @property
    def cold(self) -> bool:
        """No hold has been observed yet: the estimate rests on `expect`, if anything."""
        return self._expected >= 0

    @property
    def budget_tokens(self) -> int | None:
        return self._budget

    @property
    def committed_tokens(self) -> int:
        return self._committed

    def snapshot(self) -> Snapshot:
        return Snapshot(
            self._capacity, self._active, self._waiting, self._limit, self._budget, self._committed
        )

    def retry_after_s(self, position: int) -> float:
        """When a slot could be free for the `position`-th request from now, in seconds.

        Each of `capacity` slots turns over about once per average hold, so the request
        `position` places back gets one after about `position / capacity` holds. Clamped to
        [1, RETRY_AFTER_CAP_S] so that clients neither hammer the gate nor give up.
        """
        capacity = self._capacity or 1
        eta = self._hold_ewma_s * position / capacity
        return min(max(eta, 1.0), RETRY_AFTER_CAP_S)

    # -- changing ----------------------------------------------------------------------------

    def expect(self, hold_s: float) -> None:
        """A request about to enter should hold its slots about `hold_s`. Until a hold has
        been observed, the estimate is the mean of these; the first real one replaces it."""
        if self._expected < 0 or not math.isfinite(hold_s) or hold_s < 0:
            return
        self._expected += 1
        self._hold_ewma_s += (hold_s - self._hold_ewma_s) / self._expected

    def enter(
        self, weight: int = 1, cost: int = 0, weigh: Callable[[int], int] | None = None
    ) -> Ticket:
        """Take `weight` slots and `cost` tokens of the budget now, or a place in the line, or
        raise why neither is possible.

        A cost above the whole budget is cut to the budget: such a request runs alone (once
        nothing else holds tokens), rather than never. `weigh(capacity)` (when given: the
        request was read while the capacity was unknown) gives the weight once it is known; it
        may raise to refuse the request (here, or from the waiter's `wait`).
        """
        capacity = self._capacity
        if self._closed:
            raise ShuttingDown(self.snapshot(), self.retry_after_s(1))
        if capacity is None:
            return self._enter_unknown(weight, cost, weigh)
        if weigh is not None:
            # Known since the request was read (a big body's parse outlasted the start).
            weight = weigh(capacity)
        if weight > capacity:
            raise TooLarge(self.snapshot(), weight)
        seq = self._next_seq
        self._next_seq = seq + 1
        waiting = self._waiting
        budget = self._budget
        if budget is not None:
            cost = min(cost, budget)
        # Nobody overtakes the line: a free slot goes to a newcomer only when nobody waits.
        if (
            not waiting
            and self._active + weight <= capacity
            and (budget is None or self._fits(cost))
        ):
            self._active += weight
            self._committed += cost
            self.admitted_total += 1
            return Ticket(self, weight, seq, admitted=True, cost=cost)
        if self._limit is not None and waiting >= self._limit:
            raise QueueFull(self.snapshot(), self.retry_after_s(waiting + weight))
        ticket = Ticket(self, weight, seq, admitted=False, cost=cost)
        if cost:
            self._costs[seq] = cost
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket._future = future
        self._line.append((seq, future, weight))
        self._waiting = waiting + 1
        return ticket

    def resize(self, capacity: int | None) -> None:
        """Follow llama-server's slot count; None means it is unknown (not ready).

        Growth admits waiters at once in FIFO order. On shrink, slots held above the new
        capacity retire as their holders release them: `_dispatch` admits nobody until
        `active` is back under the ceiling.
        """
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        if capacity is None:
            # The line keeps the last known limit while llama-server is away.
            self._known.clear()
            return
        self._limit = self._policy.limit(capacity)
        self._known.set()
        if self._unsized:
            self._weigh_unsized(capacity)
        for _seq, future, weight in self._line:
            if weight > capacity and not future.done():
                self._waiting -= 1
                future.set_exception(TooLarge(self.snapshot(), weight))
        self._dispatch()

    def resize_budget(self, budget_tokens: int | None) -> None:
        """Follow the KV-cache budget; None (or 0) means it does not bind.

        Growth admits waiters at once in FIFO order; on shrink, tokens held above the new
        budget are returned as their holders finish. A waiter's cost was cut to the budget it
        entered under; one above the new budget now runs alone, once nothing else holds any.
        A waiter that entered while no budget bound is charged the whole of a new one.
        """
        # A budget that is not positive (a llama-server reporting n_ctx 0 or less) binds
        # nothing: taken as one, every cost cut to it would make the committed count negative.
        budget = budget_tokens if budget_tokens is not None and budget_tokens > 0 else None
        if budget is not None and self._budget is None:
            costs = self._costs
            for seq, future, _weight in self._line:
                if not future.done() and seq not in costs:
                    costs[seq] = self._surcharged[seq] = budget
        self._budget = budget
        self._dispatch()

    def close(self) -> None:
        """Take no new work and turn every waiter away (shutdown)."""
        self._closed = True
        error = ShuttingDown(self.snapshot(), 1.0)
        while self._line:
            _, future, _weight = self._line.popleft()
            if not future.done():
                self._waiting -= 1
                future.set_exception(error)

    async def known(self, deadline: float) -> None:
        """Until the capacity is known; NotReady past `deadline` (time.monotonic()).

        For a request that holds its slots and found llama-server restarting: it keeps them,
        since the restarted llama-server runs it as one of its slots.
        """
        self._awaiting_known += 1
        try:
            while self._capacity is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NotReady(self.snapshot(), 1.0)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._known.wait()
        finally:
            self._awaiting_known -= 1

    # -- the capacity-unknown path ------------------------------------------------------------

    def _enter_unknown(self, weight: int, cost: int, weigh: Callable[[int], int] | None) -> Ticket:
        if self._startup_wait_s is None:
            raise NotReady(self.snapshot(), 1.0)
        waiting = self._waiting
        if self._limit is not None and waiting >= self._limit:
            raise QueueFull(self.snapshot(), self.retry_after_s(waiting + weight))
        seq = self._next_seq
        self._next_seq = seq + 1
        if self._budget is not None:
            cost = min(cost, self._budget)
        ticket = Ticket(self, weight, seq, admitted=False, cost=cost)
        if cost:
            self._costs[seq] = cost
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket._future = future
        self._line.append((seq, future, weight))
        self._waiting = waiting + 1
        if weigh is not None:
            unsized = self._unsized
            if len(unsized) > 2 * self._waiting + 64:  # leavers', pruned amortised O(1)
                self._unsized = unsized = {f: e for f, e in unsized.items() if not f.done()}
            unsized[future] = (ticket, weigh)
        return ticket

    def _weigh_unsized(self, capacity: int) -> None:
        """The capacity is known: weigh whoever entered without it, in place in the line."""
        unsized, self._unsized = self._unsized, {}
        line: deque[tuple[int, asyncio.Future[None], int]] = deque()
        for seq, future, weight in self._line:
            entry = unsized.get(future)
            if entry is None or future.done():
                line.append((seq, future, weight))
                continue
            ticket, weigh = entry
            try:
                ticket.weight = weigh(capacity)
            except Exception as exc:  # the caller's refusal, handed to its waiter
                self._waiting -= 1
                future.set_exception(exc)
            line.append((seq, future, ticket.weight))
        self._line = line

    async def _until_known(self, ticket: Ticket) -> None:
        """Wait in line while the capacity is unknown, for at most the startup wait (and the
        queue timeout, when shorter); NotReady past it if it is still unknown."""
        future = ticket._future
        assert future is not None  # noqa: S101 - set by enter for every waiter
        bound_s = self._startup_wait_s or 0.0
        if self._queue_timeout_s is not None:
            bound_s = min(bound_s, self._queue_timeout_s)
        deadline = ticket.entered_at + bound_s
        while self._capacity is None and not future.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NotReady(self.snapshot(), 1.0)
            # asyncio.wait, not a timeout scope: the future must survive the timeout, as the
            # waiter stays in line once the capacity is known.
            await asyncio.wait((future,), timeout=remaining)

    # -- internals (called by Ticket) ---------------------------------------------------------

    def _leave(self, counted: bool) -> None:
        """A waiter gave up (its future is cancelled or was refused)."""
        if counted:
            self._waiting -= 1
        line = self._line
        while line and line[-1][1].done():
            line.pop()
        if len(line) > 2 * self._waiting + 64:
            self._line = deque(entry for entry in line if not entry[1].done())
        # The leaver may have been the head that blocked a lighter waiter behind it.
        self._dispatch()

    def _release(self, weight: int, hold_s: float | None) -> bool:
        self._active -= weight
        if hold_s is not None:
            if self._expected >= 0:  # the first hold seen: a measurement beats a guess
                self._expected = -1
                self._hold_ewma_s = hold_s
            self._hold_ewma_s += HOLD_EWMA_ALPHA * (hold_s - self._hold_ewma_s)
        before = self.admitted_total
        self._dispatch()
        return self.admitted_total != before

    def _dispatch(self) -> None:
        capacity = self._capacity
        if capacity is None:
            return
        line = self._line
        costs = self._costs
        while line:
            seq, future, weight = line[0]
            if future.done():  # gave up or refused: `_leave`, resize or close settled its count
                line.popleft()
                continue
            if self._active + weight > capacity:
                return
            cost = costs.get(seq, 0) if costs else 0  # none unless a budget binds
            if cost and not self._fits(cost):
                return
            line.popleft()
            if cost:
                del costs[seq]
            self._waiting -= 1
            self._active += weight
            self._committed += cost
            self.admitted_total += 1
            future.set_result(None)

    def _surcharge(self, seq: int) -> int:
        """What the ticket `seq` was charged beyond its cost (`resize_budget`), now forgotten."""
        return self._surcharged.pop(seq, 0) if self._surcharged else 0

    def _fits(self, cost: int) -> bool:
        """Does `cost` fit what the requests in flight leave of the budget? Always, when nothing
        holds any (so that no request is stranded) or when the budget does not bind."""
        budget = self._budget
        return budget is None or not self._committed or self._committed + cost <= budget

    def _position(self, seq: int) -> int:
        line = self._line
        if not line or seq < line[0][0]:
            return 0
        return min(seq - line[0][0] + 1, self._waiting)

    def _deadline(self, entered_at: float) -> float:
        assert self._queue_timeout_s is not None  # noqa: S101 - only called when set
        loop_now = asyncio.get_running_loop().time()
        return loop_now + self._queue_timeout_s - (time.monotonic() - entered_at)
