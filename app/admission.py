"""The admission core: the slots of one or more llama-servers and one bounded FIFO line.

Standard library only; it knows nothing of HTTP. One event loop owns an `Admission`: every
method runs on that loop, and the methods that change the pools (`enter`, `Ticket.release`,
`Pool.resize`) are synchronous, so no `await` can split a hand-off between two holders.

Each upstream is a `Pool` of slots (and of KV-cache tokens, when a budget binds); the fleet's
capacity is the sum of the known ones. The line is one for the fleet: its head is granted on
the pool that `routing.choose` picks among those with room, and nobody overtakes it.

While the capacity is unknown (llama-server starting or restarting) the pool admits nobody,
but with a startup wait set it still takes requests into the line, up to the last known line
limit (the policy's floor before any), each for at most the startup wait: `resize` to a known
capacity then admits them in arrival order, as any release would.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from .routing import choose, stable_hash

#: A Retry-After above this is useless: the OpenAI Python SDK does not honour one past 60 s
#: and gives up past 120 s, so the estimate is capped well below both.
RETRY_AFTER_CAP_S = 60.0
#: Until a hold has been observed or expected (`Admission.expect`), assume this one.
INITIAL_HOLD_S = 1.0
#: Weight of the newest observation in the moving average of slot hold times.
HOLD_EWMA_ALPHA = 0.2
#: Affinity keys whose last upstream is remembered (about 100 bytes each).
AFFINITY_MEMORY = 65536


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


class Pool:
    """One upstream's slots and KV-cache budget in the fleet; its capacity is None while the
    upstream is not ready (starting, restarting, down), and then nothing is routed to it."""

    __slots__ = (
        "_admission", "active", "budget", "capacity", "committed", "key", "retired", "routed",
        "salt",
    )  # fmt: skip

    def __init__(self, admission: Admission, key: str) -> None:
        self._admission = admission
        self.key = key
        #: Its rendezvous identity: the same for the same upstream on every replica.
        self.salt = stable_hash(key)
        self.capacity: int | None = None
        self.active = 0
        #: The KV-cache tokens its slots share when that binds admission (else None), and what
        #: the requests it runs hold of them.
        self.budget: int | None = None
        self.committed = 0
        #: Grants by how the pool was chosen: its key's first choice, by load, or on a retry.
        self.routed = {"affinity": 0, "load": 0, "retry": 0}
        self.retired = False

    @property
    def free(self) -> int:
        return max((self.capacity or 0) - self.active, 0)

    @property
    def cold(self) -> bool:
        return self._admission.cold

    @property
    def awaiting_capacity(self) -> bool:
        """Somebody waits for this upstream's capacity (so it is worth reading often)."""
        return self.capacity is None and self._admission.awaiting_capacity

    def resize(self, capacity: int | None) -> None:
        """Follow the upstream's slot count; None means it is unknown (not ready).

        Growth admits waiters at once in FIFO order. On shrink, slots held above the new
        capacity retire as their holders release them: nobody is admitted to this pool until
        `active` is back under the ceiling.
        """
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if self.retired:
            capacity = None
        self.capacity = capacity
        self._admission._resized()

    def resize_budget(self, budget_tokens: int | None) -> None:
        """Follow the upstream's KV-cache budget; None (or 0) means it does not bind.

        Growth admits waiters at once in FIFO order; on shrink, tokens held above the new
        budget are returned as their holders finish. A cost above the budget is cut to it when
        granted here, so such a request runs alone rather than never.
        """
        # A budget that is not positive (a llama-server reporting n_ctx 0 or less) binds
        # nothing: taken as one, every cost cut to it would make the committed count negative.
        budget = budget_tokens if budget_tokens is not None and budget_tokens > 0 else None
        admission = self._admission
        if budget is not None and not admission._budgeted:
            # Waiters already in line came at no cost: what they take is unknown, so each is
            # charged the whole budget of the pool it gets.
            for ticket in admission._line:
                ticket.costed = False
            admission._budgeted = True
        self.budget = budget
        budgets = [pool.budget for pool in admission._pools if pool.budget is not None]
        admission._budgeted = bool(budgets)
        admission._largest_budget = max(budgets) if budgets else None
        admission._dispatch()

    def retire(self) -> None:
        """The upstream is gone for good (its address left DNS): route nothing more to it; it
        leaves the fleet once its last request ends."""
        self.retired = True
        self.resize(None)
        self._admission._forget(self)

    def charge(self, ticket: Ticket) -> int:
        """The tokens of this pool's budget that `ticket` takes."""
        budget = self.budget
        if budget is None:
            return ticket.cost
        if not ticket.costed:
            return budget
        return min(ticket.cost, budget)

    def fits(self, weight: int, charge: int) -> bool:
        """Room for `weight` slots and `charge` tokens now? The tokens always fit when nothing
        holds any (so that no request is stranded) or when the budget does not bind."""
        capacity = self.capacity
        if capacity is None or self.active + weight > capacity:
            return False
        budget = self.budget
        return budget is None or not self.committed or self.committed + charge <= budget

    def __repr__(self) -> str:
        return f"<Pool {self.key} capacity={self.capacity} active={self.active}>"


class Ticket:
    """One request's claim: a place in the line, then `weight` slots of one pool and `cost`
    tokens of its KV-cache budget until released. `async with ticket:` releases it on every
    way out; an earlier `release()` is fine (a second one does nothing)."""

    __slots__ = (
        "_admission", "_future", "_known_by", "_released", "admitted_at", "affinity", "charged",
        "cost", "costed", "entered_at", "pool", "rerouted", "seq", "weight",
    )  # fmt: skip

    def __init__(
        self,
        admission: Admission,
        weight: int,
        seq: int,
        cost: int = 0,
        affinity: int | None = None,
    ) -> None:
        self._admission = admission
        self.weight = weight
        largest = admission._largest_budget
        self.cost = cost if largest is None else min(cost, largest)
        #: The cost was estimated against a budget (False: it entered before any bound, so
        #: what it takes is unknown).
        self.costed = admission._budgeted
        self.affinity = affinity
        self.seq = seq
        self.entered_at = time.monotonic()
        self.admitted_at: float | None = None
        #: The pool it holds (or was handed) slots of, and the tokens it holds there.
        self.pool: Pool | None = None
        self.charged = 0
        self.rerouted = False
        self._future: asyncio.Future[None] | None = None
        self._known_by: float | None = None
        self._released = False

    @property
    def admitted(self) -> bool:
        return self.admitted_at is not None

    @property
    def granted(self) -> bool:
        """The slots are this ticket's, even if its waiter has not resumed yet."""
        return self.pool is not None

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
            if admission._capacity is None and (admission._startup_wait_s or self._known_by):
                await admission._until_known(self)
            if admission._queue_timeout_s is None or self._known_by is not None:
                # No scope at all without QUEUE_TIMEOUT (the default): an idle timeout scope
                # costs more than the whole hand-off it would wrap. A ticket sent back by its
                # upstream waits at the head of the line, not under the queue timeout again.
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

    def reroute(self, known_by: float) -> None:
        """Its upstream did not take the request (refused, down, restarting): give its slots
        back and wait again at the head of the line, for whichever upstream has room first;
        `wait` fails with NotReady if none is known by `known_by` (time.monotonic())."""
        pool = self.pool
        if self._released or pool is None:
            return
        admission = self._admission
        hold_s = None
        self.admitted_at = None
        self.pool = None
        pool.committed -= self.charged
        self.charged = 0
        self.rerouted = True
        self._known_by = known_by
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._future = future
        # Admitted before everybody still waiting, so its place is the head.
        admission._line.appendleft(self)
        admission._waiting += 1
        admission._release(pool, self.weight, hold_s)

    def recost(self, cost: int) -> None:
        """Reserve `cost` tokens of the budget instead (a better count came in), in line or
        admitted; a lower cost may let the line move at once."""
        if self._released:
            return
        largest = self._admission._largest_budget
        self.cost = cost if largest is None else min(cost, largest)
        self.costed = True
        pool = self.pool
        if pool is not None:
            charge = pool.charge(self)
            pool.committed += charge - self.charged
            self.charged = charge
        self._admission._dispatch()

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
        pool = self.pool
        if pool is not None:
            # Admitted, or handed the slots while its waiter was giving up, before it could
            # resume: pass them on, or they leak.
            pool.committed -= self.charged
            admitted_at = self.admitted_at
            hold_s = None if admitted_at is None else time.monotonic() - admitted_at
            return admission._release(pool, self.weight, hold_s)
        future = self._future
        if future is None:
            return False
        # Refused by resize or close (an exception set) means already out of the count.
        counted = not future.done() or future.cancelled()
        future.cancel()
        admission._leave(counted)
        return False


class Admission:
    """The pools of a fleet and one FIFO line; O(1) per enter, leave and release for one pool.

    The line is a deque of tickets. A waiter that gives up is not searched for: its future is
    cancelled, it stops counting in `queued`, and `_dispatch` drops it when it reaches the head
    (most who give up are the newest and are dropped from the tail at once). When such
    leftovers outnumber the live waiters the line is rebuilt without them, so memory stays
    bounded and every operation is O(1) amortised, at a cost that does not grow with the depth.
    """

    def __init__(
        self,
        policy: QueuePolicy | None = None,
        capacity: int | None = None,
        queue_timeout_s: float | None = None,
        startup_wait_s: float | None = None,
        *,
        epsilon: float = 1.0,
    ) -> None:
        self._policy = policy or QueuePolicy()
        self._queue_timeout_s = queue_timeout_s or None
        # None or 0: refuse at once (NotReady) while the capacity is unknown.
        self._startup_wait_s = startup_wait_s or None
        self._epsilon = epsilon
        self._pools: list[Pool] = []
        self._capacity: int | None = None
        self._largest = 0  # the most slots of one known pool: a request's weight bound
        self._limit: int | None = self._policy.unknown_limit()
        # Waiters that entered while the capacity was unknown and are weighed once it is.
        self._unsized: dict[asyncio.Future[None], Callable[[int], int]] = {}
        self._awaiting_known = 0
        self._active = 0
        self._line: deque[Ticket] = deque()
        self._waiting = 0  # the live entries of _line
        self._next_seq = 0
        self._hold_ewma_s = INITIAL_HOLD_S
        self._expected = 0  # holds expected so far; -1 once a real one has been observed
        self._closed = False
        # Where each affinity key's last request ran (its prompt is cached there now), the
        # newest last; bounded, the oldest forgotten first.
        self._last: OrderedDict[int, Pool] = OrderedDict()
        self._budgeted = False  # a KV-cache budget binds on some pool
        # The largest of them: no request takes more, since it runs on one upstream.
        self._largest_budget: int | None = None
        self._changed = asyncio.Event()  # some pool's capacity changed (see _until_known)
        self.admitted_total = 0
        if capacity is not None:
            self.resize(capacity)

    # -- reading -----------------------------------------------------------------------------

    @property
    def pools(self) -> list[Pool]:
        return self._pools

    @property
    def capacity(self) -> int | None:
        """The fleet's slots: the sum over the pools whose capacity is known."""
        return self._capacity

    @property
    def largest(self) -> int | None:
        """The most slots of one known pool: a request runs in one upstream, so it can take no
        more."""
        return self._largest or None

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
        """Somebody waits for a capacity to become known (so it is worth reading often)."""
        return self._waiting > 0 or self._awaiting_known > 0

    @property
    def hold_estimate_s(self) -> float:
        return self._hold_ewma_s

    @property
    def cold(self) -> bool:
        """No hold has been observed yet: the estimate rests on `expect`, if anything."""
        return self._expected >= 0

    @property
    def budget_tokens(self) -> int | None:
        """The largest budget of one pool (what a request's cost is cut to), None if none binds."""
        return self._largest_budget

    @property
    def committed_tokens(self) -> int:
        return sum(pool.committed for pool in self._pools)

    def snapshot(self) -> Snapshot:
        budgets = [pool.budget for pool in self._pools if pool.budget is not None]
        return Snapshot(
            self._capacity,
            self._active,
            self._waiting,
            self._limit,
            sum(budgets) if budgets else None,
            self.committed_tokens,
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

    def add_pool(self, key: str) -> Pool:
        """A new upstream, not ready until its first `resize`."""
        pool = Pool(self, key)
        self._pools.append(pool)
        return pool

    def resize(self, capacity: int | None) -> None:
        """Follow the only upstream's slot count (`Pool.resize`); one pool is made for it."""
        self._only().resize(capacity)

    def resize_budget(self, budget_tokens: int | None) -> None:
        """Follow the only upstream's KV-cache budget (`Pool.resize_budget`)."""
        self._only().resize_budget(budget_tokens)

    def expect(self, hold_s: float) -> None:
        """A request about to enter should hold its slots about `hold_s`. Until a hold has
        been observed, the estimate is the mean of these; the first real one replaces it."""
        if self._expected < 0 or not math.isfinite(hold_s) or hold_s < 0:
            return
        self._expected += 1
        self._hold_ewma_s += (hold_s - self._hold_ewma_s) / self._expected

    def enter(
        self,
        weight: int = 1,
        cost: int = 0,
        weigh: Callable[[int], int] | None = None,
        affinity: int | None = None,
    ) -> Ticket:
        """Take `weight` slots of one pool and `cost` tokens of its budget now, or a place in
        the line, or raise why neither is possible.

        A cost above a pool's whole budget is cut to it: such a request runs alone there (once
        nothing else holds tokens), rather than never. `weigh(largest)` (when given: the
        request was read while no capacity was known) gives the weight once one is; it may
        raise to refuse the request (here, or from the waiter's `wait`). `affinity` is the
        request's routing key (app/routing.py).
        """
        if self._closed:
            raise ShuttingDown(self.snapshot(), self.retry_after_s(1))
        if self._capacity is None:
            return self._enter_unknown(weight, cost, weigh, affinity)
        if weigh is not None:
            # Known since the request was read (a big body's parse outlasted the start).
            weight = weigh(self._largest)
        if weight > self._largest:
            raise TooLarge(self.snapshot(), weight)
        seq = self._next_seq
        self._next_seq = seq + 1
        waiting = self._waiting
        ticket = Ticket(self, weight, seq, cost, affinity)
        # Nobody overtakes the line: a free slot goes to a newcomer only when nobody waits.
        if not waiting and self._grant(ticket):
            ticket.admitted_at = ticket.entered_at
            return ticket
        if self._limit is not None and waiting >= self._limit:
            raise QueueFull(self.snapshot(), self.retry_after_s(waiting + weight))
        ticket._future = asyncio.get_running_loop().create_future()
        self._line.append(ticket)
        self._waiting = waiting + 1
        return ticket

    def close(self) -> None:
        """Take no new work and turn every waiter away (shutdown)."""
        self._closed = True
        error = ShuttingDown(self.snapshot(), 1.0)
        while self._line:
            future = self._line.popleft()._future
            if future is not None and not future.done():
                self._waiting -= 1
                future.set_exception(error)

    # -- the capacity-unknown path ------------------------------------------------------------

    def _enter_unknown(
        self, weight: int, cost: int, weigh: Callable[[int], int] | None, affinity: int | None
    ) -> Ticket:
        if self._startup_wait_s is None:
            raise NotReady(self.snapshot(), 1.0)
        waiting = self._waiting
        if self._limit is not None and waiting >= self._limit:
            raise QueueFull(self.snapshot(), self.retry_after_s(waiting + weight))
        seq = self._next_seq
        self._next_seq = seq + 1
        ticket = Ticket(self, weight, seq, cost, affinity)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket._future = future
        self._line.append(ticket)
        self._waiting = waiting + 1
        if weigh is not None:
            unsized = self._unsized
            if len(unsized) > 2 * self._waiting + 64:  # leavers', pruned amortised O(1)
                self._unsized = unsized = {f: w for f, w in unsized.items() if not f.done()}
            unsized[future] = weigh
        return ticket

    def _weigh_unsized(self, largest: int) -> None:
        """A capacity is known: weigh whoever entered without one, in place in the line."""
        unsized, self._unsized = self._unsized, {}
        for ticket in self._line:
            future = ticket._future
            assert future is not None  # noqa: S101 - every ticket in line has one
            weigh = unsized.get(future)
            if weigh is None or future.done():
                continue
            try:
                ticket.weight = weigh(largest)
            except Exception as exc:  # the caller's refusal, handed to its waiter
                self._waiting -= 1
                future.set_exception(exc)

    async def _until_known(self, ticket: Ticket) -> None:
        """Wait in line while no capacity is known, for at most the startup wait (and the
        queue timeout, when shorter) or until the ticket's own `known_by`; NotReady past it if
        none is known yet."""
        future = ticket._future
        assert future is not None  # noqa: S101 - set by enter for every waiter
        if ticket._known_by is not None:
            deadline = ticket._known_by
        else:
            bound_s = self._startup_wait_s or 0.0
            if self._queue_timeout_s is not None:
                bound_s = min(bound_s, self._queue_timeout_s)
            deadline = ticket.entered_at + bound_s
        self._awaiting_known += 1
        try:
            while self._capacity is None and not future.done():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NotReady(self.snapshot(), 1.0)
                # asyncio.wait, not a timeout scope: the future must survive the timeout, as
                # the waiter stays in line once a capacity is known.
                await asyncio.wait((future,), timeout=remaining)
        finally:
            self._awaiting_known -= 1

    # -- internals (called by Pool and Ticket) --------------------------------------------------

    def _only(self) -> Pool:
        pools = self._pools
        if not pools:
            return self.add_pool("upstream")
        if len(pools) > 1:
            raise RuntimeError("several pools: resize each one (Pool.resize)")
        return pools[0]

    def _resized(self) -> None:
        """A pool's capacity changed: the fleet's sums, the line's limit, then whoever fits."""
        known = [pool.capacity for pool in self._pools if pool.capacity is not None]
        if not known:
            # The line keeps the last known limit while every upstream is away.
            self._capacity = None
            self._largest = 0
            return
        self._capacity = sum(known)
        largest = self._largest = max(known)
        self._limit = self._policy.limit(self._capacity)
        if self._unsized:
            self._weigh_unsized(largest)
        for ticket in self._line:
            future = ticket._future
            if ticket.weight > largest and future is not None and not future.done():
                self._waiting -= 1
                future.set_exception(TooLarge(self.snapshot(), ticket.weight))
        self._dispatch()

    def _forget(self, pool: Pool) -> None:
        """Drop retired pools that nobody holds slots of any more."""
        self._pools = [p for p in self._pools if not (p.retired and p.active == 0)]

    def _leave(self, counted: bool) -> None:
        """A waiter gave up (its future is cancelled or was refused)."""
        if counted:
            self._waiting -= 1
        line = self._line
        while line and _gone(line[-1]):
            line.pop()
        if len(line) > 2 * self._waiting + 64:
            self._line = deque(ticket for ticket in line if not _gone(ticket))
        # The leaver may have been the head that blocked a lighter waiter behind it.
        self._dispatch()

    def _release(self, pool: Pool, weight: int, hold_s: float | None) -> bool:
        pool.active -= weight
        self._active -= weight
        if pool.retired and not pool.active:
            self._forget(pool)
        if hold_s is not None:
            if self._expected >= 0:  # the first hold seen: a measurement beats a guess
                self._expected = -1
                self._hold_ewma_s = hold_s
            self._hold_ewma_s += HOLD_EWMA_ALPHA * (hold_s - self._hold_ewma_s)
        before = self.admitted_total
        self._dispatch()
        return self.admitted_total != before

    def _grant(self, ticket: Ticket) -> bool:
        """Give `ticket` its slots on the pool routing picks, if any has room for it now."""
        pools = self._pools
        if len(pools) == 1:
            # One upstream: nothing to choose, and the hot path stays as short as it was.
            pool = pools[0]
            if not pool.fits(ticket.weight, pool.charge(ticket)):
                return False
            first = ticket.affinity is not None
        else:
            weight = ticket.weight
            key = ticket.affinity
            last = self._last
            chosen = choose(
                pools,
                weight,
                lambda pool: pool.fits(weight, pool.charge(ticket)),
                key,
                self._epsilon,
                None if key is None else last.get(key),
            )
            if chosen is None:
                return False
            pool, first = chosen
            if key is not None:
                last[key] = pool
                last.move_to_end(key)
                if len(last) > AFFINITY_MEMORY:
                    last.popitem(last=False)
        charge = pool.charge(ticket)
        pool.active += ticket.weight
        pool.committed += charge
        pool.routed["retry" if ticket.rerouted else "affinity" if first else "load"] += 1
        ticket.pool = pool
        ticket.charged = charge
        self._active += ticket.weight
        self.admitted_total += 1
        return True

    def _dispatch(self) -> None:
        if self._capacity is None:
            return
        line = self._line
        while line:
            ticket = line[0]
            future = ticket._future
            assert future is not None  # noqa: S101 - every ticket in line has one
            if future.done():  # gave up or refused: `_leave`, resize or close settled its count
                line.popleft()
                continue
            if not self._grant(ticket):
                return
            line.popleft()
            self._waiting -= 1
            future.set_result(None)

    def _position(self, seq: int) -> int:
        line = self._line
        if not line or seq < line[0].seq:
            return 0
        return min(seq - line[0].seq + 1, self._waiting)

    def _deadline(self, entered_at: float) -> float:
        assert self._queue_timeout_s is not None  # noqa: S101 - only called when set
        loop_now = asyncio.get_running_loop().time()
        return loop_now + self._queue_timeout_s - (time.monotonic() - entered_at)


def _gone(ticket: Ticket) -> bool:
    future = ticket._future
    return future is None or future.done()
