"""The admission core: the slots of one or more llama-servers and one bounded FIFO line.

Standard library only; it knows nothing of HTTP. One event loop owns an `Admission`: every
method runs on that loop, and the methods that change the pools (`enter`, `Ticket.release`,
`Pool.resize`) are synchronous, so no `await` can split a hand-off between two holders.

Each upstream is a `Pool` of slots (and of KV-cache tokens, when a budget binds); the fleet's
capacity is the sum of the known ones. The line is one for the fleet: its head is granted on
the pool that `routing.choose` picks among those with room, and nobody overtakes it on an
upstream it could run on (`_dispatch`).

While the capacity is unknown (llama-server starting or restarting) the pool admits nobody,
but with a startup wait set it still takes requests into the line, up to the last known line
limit (the policy's floor before any), each for at most the startup wait: `resize` to a known
capacity then admits them in arrival order, as any release would.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import functools
import heapq
import itertools
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from slotgate.errors import (
    AdmissionError,
    NotReady,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    TenantQueueFull,
    TenantTooLarge,
    TooLarge,
)
from slotgate.gate.fairline import FairLine, Share
from slotgate.gate.routing import choose, stable_hash
from slotgate.gate.tenants import EVERYONE, Tenant

#: A Retry-After above this is useless: the OpenAI Python SDK does not honour one past 60 s
#: and gives up past 120 s, so the estimate is capped well below both.
RETRY_AFTER_CAP_S = 60.0
#: While no hold has been seen, a refused request is told at most this many expected holds.
COLD_PROMISE_HOLDS = 2.0
#: A client told a moment comes back about then, give or take this (Retry-After in whole
#: seconds, its own latency): an arrival this close to a promised moment keeps that promise.
RETURN_GRACE_S = 0.5
#: Promises matched one by one to the moments places free (the cost of a refusal); the ones
#: further out count a place each.
MATCHED_PROMISES = 16
#: A burst's refusals are told within a fraction of this; a refused request that comes while
#: a promise at least this old is still ahead is taken for one of those clients back early.
EARLY_RETURN_S = 0.4
#: Until a hold has been observed or expected (`Admission.expect`), assume this one.
INITIAL_HOLD_S = 1.0
#: Weight of the newest observation in the moving average of slot hold times.
HOLD_EWMA_ALPHA = 0.2
#: Affinity keys whose last upstream is remembered (about 100 bytes each).
AFFINITY_MEMORY = 65536
#: How far behind the head the line is searched for requests that can run where the head
#: cannot (`Admission._backfill`).
BACKFILL_SCAN = 1024


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
    #: The refused request's tenant, when its own limit refused it (TenantQueueFull).
    tenant: Share | None = None

    @property
    def free(self) -> int:
        return max((self.capacity or 0) - self.active, 0)

    @property
    def free_tokens(self) -> int | None:
        if self.budget_tokens is None:
            return None
        return max(self.budget_tokens - self.committed_tokens, 0)


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


class Claim(Protocol):
    """What the request path needs of a request's claim on the slots: a `Ticket` of this core,
    or a `ReplicaTicket` when replicas share the line through Redis (app/replicas/replica.py)."""

    @property
    def admitted(self) -> bool: ...
    @property
    def admitted_at(self) -> float | None: ...
    @property
    def weight(self) -> int: ...
    @property
    def wait_s(self) -> float: ...
    @property
    def pool(self) -> Pool | None: ...
    @property
    def position(self) -> int: ...
    async def wait(self) -> None: ...
    def release(self) -> bool: ...
    def reroute(self, known_by: float) -> None: ...
    def recost(self, cost: int) -> None: ...
    async def __aenter__(self) -> Claim: ...
    async def __aexit__(self, *exc_info: object) -> None: ...


class Pool:
    """One upstream's slots and KV-cache budget in the fleet; its capacity is None while the
    upstream is not ready (starting, restarting, down), and then nothing is routed to it."""

    __slots__ = (
        "_admission", "active", "budget", "capacity", "committed", "key", "retired", "routed",
        "salt", "seen",
    )  # fmt: skip

    def __init__(self, admission: Admission, key: str) -> None:
        self._admission = admission
        self.key = key
        #: Its rendezvous identity: the same for the same upstream on every replica.
        self.salt = stable_hash(key)
        self.capacity: int | None = None
        #: Its last known capacity: what it likely has again once back.
        self.seen = 0
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
        if capacity is not None:
            self.seen = capacity
        self._admission._resized()
        self._admission._notify(self)

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
            for ticket in admission._in_line():
                ticket.costed = False
            admission._budgeted = True
        self.budget = budget
        budgets = [pool.budget for pool in admission._pools if pool.budget is not None]
        admission._budgeted = bool(budgets)
        admission._largest_budget = max(budgets) if budgets else None
        admission._dispatch()
        admission._notify(self)

    def retire(self) -> None:
        """The upstream is gone for good (its address left DNS): route nothing more to it; it
        leaves the fleet once its last request ends."""
        self.retired = True
        self.resize(None)
        self._admission._forget(self)

    def rename(self, key: str) -> None:
        """Its upstream is known by another URL now (an address of its name)."""
        self.key = key
        self.salt = stable_hash(key)
        self._admission._notify(self)

    def revive(self) -> None:
        """Its upstream is back before it left (its address returned while its last requests
        ran): route to it again from its next `resize`."""
        self.retired = False

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
        "cost", "costed", "entered_at", "least", "memo", "pool", "rerouted", "seq", "tasks",
        "tenant", "weight",
    )  # fmt: skip

    def __init__(
        self,
        admission: Admission,
        weight: int,
        seq: int,
        cost: int = 0,
        affinity: int | None = None,
        tenant: Tenant = EVERYONE,
        conversation: int | None = None,
        tasks: int = 0,
    ) -> None:
        self._admission = admission
        self.weight = weight
        #: The fewest slots it runs in (its choices); and for a prompt array, the tasks
        #: llama-server makes of it (0 for any other): it runs as many at once as its upstream
        #: has slots, so what it holds is known only where it is granted (`weighs`).
        self.least = weight
        self.tasks = tasks
        #: Whom it is for (app/gate/tenants.py); its band is the band it waits in.
        self.tenant = tenant
        largest = admission._largest_budget
        self.cost = cost if largest is None else min(cost, largest)
        #: The cost was estimated against a budget (False: it entered before any bound, so
        #: what it takes is unknown).
        self.costed = admission._budgeted
        self.affinity = affinity
        #: The key its upstream is remembered by: its conversation's, else its affinity key.
        self.memo = conversation if conversation is not None else affinity
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
    def band(self) -> int:
        return self.tenant.band

    @property
    def granted(self) -> bool:
        """The slots are this ticket's, even if its waiter has not resumed yet."""
        return self.pool is not None

    @property
    def wait_s(self) -> float:
        return (self.admitted_at or time.monotonic()) - self.entered_at

    def weighs(self, capacity: int) -> int:
        """The slots it holds on a pool of `capacity` (more than that if it cannot run there)."""
        tasks = self.tasks
        return self.weight if not tasks else max(self.least, min(tasks, capacity))

    @property
    def position(self) -> int:
        """1-based place in the line (approximate after cancellations ahead); 0 once admitted."""
        if self.admitted:
            return 0
        fair = self._admission._fair
        if fair is not None:
            return min(fair.position(self), self._admission._waiting)
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
                # No scope at all without QUEUE_TIMEOUT_S (the default): an idle timeout scope
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
        weight = self.weight
        fair = admission._fair
        if fair is not None:
            fair.released(self, hold_s)
        if self.tasks:
            # Its next upstream may have more slots than this one: llama-server fills them.
            self.weight = self.weighs(admission._largest)
            limit = self.tenant.max_active
            if limit is not None and self.weight > limit:
                future.set_exception(TenantTooLarge(admission.snapshot(), self.weight, self.tenant))
                admission._release(self, pool, weight, hold_s)
                return
        # Admitted before everybody still waiting, so its place is the head (of its band).
        if fair is None:
            admission._line.appendleft(self)
        else:
            fair.push_front(self)
        admission._waiting += 1
        admission._release(self, pool, weight, hold_s)

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
            if admission._fair is not None:
                admission._fair.released(self, hold_s)
            return admission._release(self, pool, self.weight, hold_s)
        future = self._future
        if future is None:
            return False
        # Refused by resize or close (an exception set) means already out of the count.
        counted = not future.done() or future.cancelled()
        future.cancel()
        admission._leave(self, counted)
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
        self._waiting = 0  # the live entries of _line (or of _fair)
        # While every request is one tenant's, in one band (always, without keys), the line is
        # the plain deque above; the first request of another tenant or band, or of a tenant
        # with limits, moves the waiters to a fair line for good (`_share`).
        self._fair: FairLine[Ticket] | None = None
        self._solo: Tenant | None = None
        self._next_seq = 0
        self._hold_ewma_s = INITIAL_HOLD_S
        self._expected = 0  # holds expected so far; -1 once a real one has been observed
        self._closed = False
        # Who holds slots (ticket: when granted, weight), in the order granted, for `eta_s`.
        self._holders: dict[Ticket, tuple[float, int]] = {}
        # The moments refused requests were told a place should be free, and when each was
        # told (`_promise_s`), in the order of the moments.
        self._promised: list[tuple[float, float]] = []
        self._jitter = random.Random()  # noqa: S311 - spreading retries, not a secret
        # Where each affinity key's last request ran (its prompt is cached there now), the
        # newest last; bounded, the oldest forgotten first.
        self._last: OrderedDict[int, Pool] = OrderedDict()
        self._budgeted = False  # a KV-cache budget binds on some pool
        # The largest of them: no request takes more, since it runs on one upstream.
        self._largest_budget: int | None = None
        self._changed = asyncio.Event()  # some pool's capacity changed (see _until_known)
        #: Told of every change to a pool's capacity, budget or name (the shared line through
        #: Redis follows them: app/replicas/replica.py).
        self.on_change: Callable[[Pool], None] | None = None
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
        """When a slot could be free for the `position`-th request from now, in seconds
        (`eta_s`), clamped to [1, RETRY_AFTER_CAP_S] so that clients neither hammer the gate
        nor give up."""
        return min(max(self.eta_s(position), 1.0), RETRY_AFTER_CAP_S)

    def eta_s(self, position: int) -> float:
        """When the `position`-th slot to free from now should free, in seconds.

        The running generations end first, the longest-running first: each about an average
        hold after it began, or, once past that, after half as long again as it has run (a
        generation already long is likely a long one). After them each slot turns over once
        per average hold.
        """
        capacity = self._capacity or 1
        hold = self._hold_ewma_s
        rounds, index = divmod(max(position, 1) - 1, capacity)
        residual = 0.0
        if index < self._active:
            now = time.monotonic()
            slots = 0
            for granted_at in self._holders.values():  # in the order they were granted
                slots += granted_at[1]
                if slots > index:
                    elapsed = now - granted_at[0]
                    residual = max(hold - elapsed, elapsed / 2)
                    break
        return residual + rounds * hold

    def estimate_s(self) -> float:
        """The Retry-After a request refused now would be told (`_promise_s`, without its
        random part and without promising it), for /admission."""
        return self._promise_s(record=False)

    def _promise_s(self, kept: bool = False, record: bool = True) -> float:
        """The Retry-After of a request that the full line turns away: when a place is likely
        to be free for it. `kept`: its arrival kept a promise (`_keep`).

        A place frees each time a slot does (the head of the line takes it), at the moments
        `_frees` estimates. Each refusal is promised the first such moment that no earlier
        promise still stands for (a little after it), so that a burst's clients come back
        spread over the moments places free up and the line refills as it drains; nobody is
        told to wait for the whole line. What a promise stands for is bounded three ways,
        none of which needs to know who a client is:

        - A promise stands for one moment near its own (within a step or RETURN_GRACE_S);
          promises beyond what the pool frees in that time (a cold burst told one guessed
          moment all together) push nobody further: their clients will be refused again and
          told then, counted once.
        - An arrival near a promised moment keeps that promise, which stops counting (it is
          that client back, or someone taking the place it stood for). A refused arrival
          that keeps none while a promise told at least EARLY_RETURN_S ago is still ahead
          takes that promise over: one client back early (ignoring Retry-After) stands for
          one place, however often it comes.
        - A moment that passes with nobody arriving shows its client is not coming: the
          promises told before it are forgotten with it.

        So the promises stand for at most the clients refused within EARLY_RETURN_S or kept
        coming since, each for one place the pool frees, and they drain as soon as clients
        stop coming back: an estimate stays when this client could expect a place.
        """
        now = time.monotonic()
        promised = self._purge(now)
        if not kept:
            early = now - EARLY_RETURN_S
            for i in range(min(len(promised), MATCHED_PROMISES)):
                if promised[i][1] <= early:
                    # Taken over: one back early. In place when recording (a storm keeps
                    # thousands of promises: copying them per refusal cost more than the rest).
                    if record:
                        del promised[i]
                    else:
                        promised = promised[:i] + promised[i + 1 :]
                    break
        hold = self._hold_ewma_s
        step = hold / (self._capacity or 1)
        near = max(step, RETURN_GRACE_S)
        # No hold seen yet: the guess errs late by design, and moments spaced by it would
        # leave slots idle for as long as it is wrong. Nobody is told more than two guessed
        # holds; by then real ones are known and a second refusal is precise.
        ceiling = COLD_PROMISE_HOLDS * hold if self.cold else RETRY_AFTER_CAP_S
        i = 0
        eta = RETRY_AFTER_CAP_S
        for matched, frees in enumerate(self._frees(now)):
            frees = min(frees, ceiling)
            if frees >= RETRY_AFTER_CAP_S:
                break
            if matched == MATCHED_PROMISES:
                # Far enough out: the rest count a place each, each a step further.
                eta = min(frees + (len(promised) - i) * step, ceiling)
                break
            at = now + frees
            if i < len(promised) and promised[i][0] < at - near:
                # Those before stand for no moment the pool frees (they may still be kept).
                i = bisect.bisect_left(promised, (at - near, -math.inf), i)
            if i < len(promised) and promised[i][0] <= at + near:
                i += 1
                continue
            eta = frees
            break
        # Told the very moment a place should free, a client races the release it waits for;
        # a little later costs nothing while the line's waiters keep the slots busy. A
        # quarter of the step between places, and up to a quarter more at random to spread
        # a crowd.
        eta += step / 4
        if not record:
            return min(max(eta, 0.05), RETRY_AFTER_CAP_S)
        eta += self._jitter.uniform(0.0, step / 4)
        if eta < RETRY_AFTER_CAP_S:
            # Beyond the cap nothing is promised.
            bisect.insort(promised, (now + eta, now))
        return min(max(eta, 0.05), RETRY_AFTER_CAP_S)

    def _frees(self, now: float) -> Iterator[float]:
        """When the slots free from now on, in seconds, earliest first: each held slot as
        `eta_s` has it, then every slot once per average hold."""
        capacity = self._capacity or 1
        hold = self._hold_ewma_s
        residuals: list[float] = []
        for granted_at, weight in self._holders.values():  # in the order they were granted
            elapsed = now - granted_at
            residuals += [max(hold - elapsed, elapsed / 2)] * weight
            if len(residuals) >= capacity:
                break
        residuals = residuals[:capacity]
        residuals += [0.0] * (capacity - len(residuals))
        heapq.heapify(residuals)
        while True:
            frees = residuals[0]
            yield frees
            heapq.heapreplace(residuals, frees + hold)

    def _keep(self, now: float) -> bool:
        """An arrival at `now`: the promise due nearest, if near enough, is kept by it (not
        one told so recently that its client cannot have waited half of it)."""
        promised = self._purge(now)
        if promised:
            moment, told = promised[0]
            if moment <= now + RETURN_GRACE_S and now - told >= (moment - told) / 2:
                del promised[0]
                return True
        return False

    def _purge(self, now: float) -> list[tuple[float, float]]:
        """Forget the moments that passed with nobody arriving, and every promise told
        before them: their clients are not all coming back."""
        promised = self._promised
        passed = bisect.bisect_left(promised, (now - RETURN_GRACE_S, -math.inf))
        if passed:
            before = max(told for _, told in promised[:passed])
            promised = self._promised = [p for p in promised[passed:] if p[1] > before]
        return promised

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
        *,
        tenant: Tenant = EVERYONE,
        band: int | None = None,
        conversation: int | None = None,
        tasks: int = 0,
    ) -> Ticket:
        """Take `weight` slots of one pool and `cost` tokens of its budget now, or a place in
        the line, or raise why neither is possible.

        A cost above a pool's whole budget is cut to it: such a request runs alone there (once
        nothing else holds tokens), rather than never. `weigh(largest)` (when given: the
        request was read while no capacity was known) gives the weight once one is; it may
        raise to refuse the request (here, or from the waiter's `wait`). `affinity` is the
        request's routing key (app/gate/routing.py). `tenant` is whom it is for, `band` the band it
        waits in (its tenant's unless lower, app/gate/tenants.py). `tasks`, when more than
        `weight`, is the tasks llama-server makes of a prompt array: it holds as many slots as
        it has tasks, up to the slots of the pool that grants it (`weight` at least).
        """
        if self._closed:
            raise ShuttingDown(self.snapshot(), self.retry_after_s(1))
        kept = bool(self._promised) and self._keep(time.monotonic())
        if band is not None and band != tenant.band:
            tenant = tenant.lowered(band)
        fair = self._fair
        if tenant is not self._solo and fair is None:
            fair = self._share(tenant)
        if self._capacity is None:
            return self._enter_unknown(
                weight, cost, weigh, affinity, tenant, conversation, tasks, kept
            )
        if weigh is not None:
            # Known since the request was read (a big body's parse outlasted the start).
            weighed = weigh(self._largest)
            if not tasks:
                weight = weighed
        if weight > self._largest:
            raise TooLarge(self.snapshot(), weight, self._largest)
        seq = self._next_seq
        self._next_seq = seq + 1
        waiting = self._waiting
        ticket = Ticket(self, weight, seq, cost, affinity, tenant, conversation, tasks)
        if tasks:
            weight = ticket.weight = ticket.weighs(self._largest)
        # Nobody overtakes the line: a free slot goes to a newcomer only when nobody waits
        # (nobody who may run, with tenants: one at its max_active may not).
        if fair is None:
            if not waiting and self._grant(ticket):
                ticket.admitted_at = ticket.entered_at
                return ticket
        elif (limit := tenant.max_active) is not None and weight > limit:
            raise TenantTooLarge(self.snapshot(), weight, tenant)
        elif (
            self._active + weight <= self._capacity  # cheap, and enough to rule most out
            and fair.head() is None
            and self._may_run(fair, ticket)
            and self._grant(ticket)
        ):
            fair.granted(ticket)
            ticket.admitted_at = ticket.entered_at
            return ticket
        if self._limit is not None and waiting >= self._limit:
            raise QueueFull(self.snapshot(), self._promise_s(kept))
        ticket._future = asyncio.get_running_loop().create_future()
        if fair is None:
            self._line.append(ticket)
            self._waiting = waiting + 1
            if waiting and len(self._pools) > 1 and self._active < self._capacity:
                self._dispatch()  # it may run at once where the head never can
            return ticket
        self._check_tenant(fair, ticket)
        fair.push(ticket)
        self._waiting = waiting + 1
        if len(self._pools) > 1 and self._active < self._capacity:
            self._dispatch()  # it may run at once where the head never can
        return ticket

    def hold(
        self,
        pool: Pool,
        weight: int,
        cost: int = 0,
        affinity: int | None = None,
        *,
        tenant: Tenant = EVERYONE,
        reason: str = "load",
        conversation: int | None = None,
    ) -> Ticket:
        """Count slots that the fleet's shared line (replicas/replica.py) granted this replica on
        `pool`, room or not: Redis is the judge then, and this core keeps this replica's part
        (what it holds of each upstream, its tenants', the holds behind its estimates)."""
        fair = self._fair
        if tenant is not self._solo and fair is None:
            fair = self._share(tenant)
        seq = self._next_seq
        self._next_seq = seq + 1
        ticket = Ticket(self, weight, seq, cost, affinity, tenant, conversation)
        self._take(ticket, pool, reason)
        if fair is not None:
            fair.granted(ticket)
        if ticket.memo is not None:
            self._remember(ticket.memo, pool)
        ticket.admitted_at = ticket.entered_at
        return ticket

    def last_pool(self, memo: int) -> Pool | None:
        """The pool that ran the last request of this conversation (or affinity key): its
        prompt is cached there."""
        return self._last.get(memo)

    def tenant_counts(self, name: str) -> tuple[int, int]:
        """(slots held, waiters) of the tenant `name`."""
        fair = self._fair
        if fair is not None:
            return fair.counts(name)
        solo = self._solo
        if solo is not None and solo.name == name:
            return self._active, self._waiting
        return 0, 0

    def retune(self, tenants: Iterable[Tenant]) -> None:
        """Reloaded tenants (API_KEYS_FILE on SIGHUP): their weights and limits from now on."""
        tenants = tuple(tenants)
        solo = self._solo
        if solo is not None:
            for tenant in tenants:
                if tenant.name == solo.name:
                    limited = tenant.max_active is not None or tenant.max_queued is not None
                    # None: the next request of anyone moves the line to a fair one.
                    self._solo = None if limited else tenant
        fair = self._fair
        if fair is not None:
            fair.retune(tenants)
            limits = {tenant.name: tenant for tenant in tenants if tenant.max_active is not None}
            for ticket in self._in_line():
                future = ticket._future
                reloaded = limits.get(ticket.tenant.name)
                if reloaded is None or future is None or future.done():
                    continue
                limit = reloaded.max_active
                if limit is not None and ticket.weight > limit:
                    # Lowered below what it asks: it could never run.
                    self._waiting -= 1
                    future.set_exception(TenantTooLarge(self.snapshot(), ticket.weight, reloaded))
                    fair.leave(ticket)
            self._dispatch()

    def close(self) -> None:
        """Take no new work and turn every waiter away (shutdown)."""
        self._closed = True
        error = ShuttingDown(self.snapshot(), 1.0)
        while self._line:
            future = self._line.popleft()._future
            if future is not None and not future.done():
                self._waiting -= 1
                future.set_exception(error)
        if self._fair is not None:
            for ticket in self._fair.drain():
                assert ticket._future is not None  # noqa: S101 - every ticket in line has one
                self._waiting -= 1
                ticket._future.set_exception(error)

    # -- the capacity-unknown path ------------------------------------------------------------

    def _enter_unknown(
        self,
        weight: int,
        cost: int,
        weigh: Callable[[int], int] | None,
        affinity: int | None,
        tenant: Tenant,
        conversation: int | None = None,
        tasks: int = 0,
        kept: bool = False,
    ) -> Ticket:
        if self._startup_wait_s is None:
            raise NotReady(self.snapshot(), 1.0)
        waiting = self._waiting
        if self._limit is not None and waiting >= self._limit:
            raise QueueFull(self.snapshot(), self._promise_s(kept))
        seq = self._next_seq
        self._next_seq = seq + 1
        ticket = Ticket(self, weight, seq, cost, affinity, tenant, conversation, tasks)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket._future = future
        fair = self._fair
        if fair is None:
            self._line.append(ticket)
        else:
            self._check_tenant(fair, ticket)
            fair.push(ticket)
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
        for ticket in self._in_line():
            future = ticket._future
            assert future is not None  # noqa: S101 - every ticket in line has one
            weigh = unsized.get(future)
            if weigh is None or future.done():
                continue
            try:
                ticket.weight = weigh(largest)
                if not ticket.tasks:
                    ticket.least = ticket.weight
            except Exception as exc:  # the caller's refusal, handed to its waiter
                self._waiting -= 1
                future.set_exception(exc)
                if self._fair is not None:
                    self._fair.leave(ticket)

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
        # An upstream away may come back with as many slots as before: a waiter that only it
        # fits is told to retry (503), not to ask for less (400).
        likely = max([pool.seen for pool in self._pools if not pool.retired], default=0)
        for ticket in self._in_line():
            future = ticket._future
            if future is None or future.done():
                continue
            if ticket.tasks:
                # A prompt array fills as many slots as its upstream has, now more or fewer.
                ticket.weight = ticket.weighs(largest)
            limit = ticket.tenant.max_active
            error: AdmissionError
            if ticket.least > largest:
                if ticket.least <= likely:
                    error = NotReady(self.snapshot(), self.retry_after_s(1))
                else:
                    error = TooLarge(self.snapshot(), ticket.least, largest)
            elif limit is not None and ticket.weight > limit:
                error = TenantTooLarge(self.snapshot(), ticket.weight, ticket.tenant)
            else:
                continue
            self._waiting -= 1
            future.set_exception(error)
            if self._fair is not None:
                self._fair.leave(ticket)
        self._dispatch()

    def _forget(self, pool: Pool) -> None:
        """Drop retired pools that nobody holds slots of any more."""
        self._pools = [p for p in self._pools if not (p.retired and p.active == 0)]

    def _leave(self, ticket: Ticket, counted: bool) -> None:
        """A waiter gave up (its future is cancelled or was refused)."""
        if counted:
            self._waiting -= 1
        fair = self._fair
        if fair is not None:
            if counted:  # one refused was uncounted there when refused
                fair.leave(ticket)
            self._dispatch()
            return
        line = self._line
        while line and _gone(line[-1]):
            line.pop()
        if len(line) > 2 * self._waiting + 64:
            self._line = deque(ticket for ticket in line if not _gone(ticket))
        # The leaver may have been the head that blocked a lighter waiter behind it.
        self._dispatch()

    def _release(self, ticket: Ticket, pool: Pool, weight: int, hold_s: float | None) -> bool:
        self._holders.pop(ticket, None)
        pool.active -= weight
        self._active -= weight
        if pool.retired and not pool.active:
            self._forget(pool)
        if hold_s is not None:
            self._observe(hold_s)
        before = self.admitted_total
        self._dispatch()
        return self.admitted_total != before

    def _observe(self, hold_s: float) -> None:
        """A hold ended after `hold_s`: the moving average behind every estimate."""
        if self._expected >= 0:  # the first hold seen: a measurement beats a guess
            self._expected = -1
            self._hold_ewma_s = hold_s
        self._hold_ewma_s += HOLD_EWMA_ALPHA * (hold_s - self._hold_ewma_s)

    def _grant(self, ticket: Ticket) -> bool:
        """Give `ticket` its slots on the pool routing picks, if any has room for it now."""
        pools = self._pools
        if len(pools) == 1:
            # One upstream: nothing to choose, and the hot path stays as short as it was (an
            # array's weight is this pool's already: `_resized` weighs every waiter again).
            pool = pools[0]
            if not pool.fits(ticket.weight, pool.charge(ticket)):
                return False
            first = ticket.affinity is not None
            self._take(
                ticket, pool, "retry" if ticket.rerouted else "affinity" if first else "load"
            )
            return True
        return self._route(ticket, pools)

    def _route(self, ticket: Ticket, pools: list[Pool]) -> bool:
        """`_grant` among `pools`: the one routing picks of those with room for it now."""
        # Its conversation's last upstream first (else its key's): its history is cached
        # there; its key's rendezvous order next, where the shared prompt start is.
        memo = ticket.memo
        weight = ticket.weight
        fits: Callable[[Pool], bool]
        if ticket.tasks:
            # A prompt array takes as many slots as it has tasks, up to each upstream's.
            def fits(pool: Pool) -> bool:
                return pool.fits(ticket.weighs(pool.capacity or 0), pool.charge(ticket))
        else:

            def fits(pool: Pool) -> bool:
                return pool.fits(weight, pool.charge(ticket))

        chosen = choose(
            pools,
            weight,
            fits,
            ticket.affinity,
            self._epsilon,
            None if memo is None else self._last.get(memo),
            ticket.seq,
        )
        if chosen is None:
            return False
        pool, first = chosen
        if memo is not None:
            self._remember(memo, pool)
        if ticket.tasks:
            ticket.weight = ticket.weighs(pool.capacity or 0)
        self._take(ticket, pool, "retry" if ticket.rerouted else "affinity" if first else "load")
        return True

    def _take(self, ticket: Ticket, pool: Pool, reason: str) -> None:
        """`ticket` holds its slots and tokens of `pool` from now on."""
        charge = pool.charge(ticket)
        pool.active += ticket.weight
        pool.committed += charge
        pool.routed[reason] += 1
        ticket.pool = pool
        ticket.charged = charge
        self._holders[ticket] = (time.monotonic(), ticket.weight)
        self._active += ticket.weight
        self.admitted_total += 1

    def _remember(self, key: int, pool: Pool) -> None:
        last = self._last
        last[key] = pool
        last.move_to_end(key)
        if len(last) > AFFINITY_MEMORY:
            last.popitem(last=False)

    def _notify(self, pool: Pool) -> None:
        if self.on_change is not None:
            self.on_change(pool)

    def _dispatch(self) -> None:
        """Grant the line's head while it fits; then, in a fleet, those behind it that can run
        where it never can.

        The rule: a waiter behind the head may take slots only of an upstream with fewer slots
        than the head asks at least (its choices), and than every other waiter ahead of it
        that could use that upstream: slots none of them can use. The head is therefore
        granted exactly when it would be without this, as soon as an upstream it fits has room
        (while the capacities stay as they are: an upstream that grows to fit the head finds
        its slots held by those it ran meanwhile). Among the waiters that could use the same
        upstream, first come first served, or, with tenants, the fair order and bands.
        """
        capacity = self._capacity
        if capacity is None:
            return
        fair = self._fair
        if fair is not None:
            while (head := fair.head()) is not None:
                if not self._grant(head):
                    if len(self._pools) > 1:
                        self._backfill_fair(fair, head)
                    return
                fair.pop_head()
                fair.granted(head)
                self._waiting -= 1
                assert head._future is not None  # noqa: S101 - every ticket in line has one
                head._future.set_result(None)
                if self._active >= capacity:
                    return  # full: no need to find the next head
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
                if len(self._pools) > 1:
                    self._backfill(ticket)
                return
            line.popleft()
            self._waiting -= 1
            future.set_result(None)

    def _backfill(self, head: Ticket) -> None:
        """The head waits: grant waiters behind it on the upstreams it can never run on
        (`_dispatch` states the rule). A waiter that does not fit yet keeps the upstreams it
        could use for itself, from everyone behind it: `floor` falls to what it asks."""
        floor = head.least
        open_ = [p for p in self._pools if p.active < (p.capacity or 0) < floor]
        granted: list[Ticket] = []
        # Bounded, so that a release behind a long line of heavy waiters stays cheap; those
        # further back wait for the next release.
        for ticket in itertools.islice(self._line, 1, BACKFILL_SCAN):
            if not open_:
                break
            future = ticket._future
            assert future is not None  # noqa: S101 - every ticket in line has one
            if future.done() or ticket.least >= floor:
                continue
            if self._route(ticket, open_):
                self._waiting -= 1
                future.set_result(None)
                granted.append(ticket)
            else:
                floor = ticket.least
            open_ = [p for p in open_ if p.active < (p.capacity or 0) < floor]
        for ticket in granted:
            # Out of the line at once: a reroute puts it back at the head, and it must not
            # be in it twice.
            self._line.remove(ticket)

    def _backfill_fair(self, fair: FairLine[Ticket], head: Ticket) -> None:
        """`_backfill` in a fair line: the rule is the same, with "ahead" meaning "served
        first": among those that may run where the head cannot, the fair order decides."""
        floor = head.least
        open_ = [p for p in self._pools if p.active < (p.capacity or 0) < floor]
        while open_:
            ticket = fair.first(functools.partial(_lighter, floor), BACKFILL_SCAN)
            if ticket is None:
                return
            if self._route(ticket, open_):
                fair.take(ticket)
                self._waiting -= 1
                assert ticket._future is not None  # noqa: S101 - every ticket in line has one
                ticket._future.set_result(None)
            else:
                floor = ticket.least
            open_ = [p for p in open_ if p.active < (p.capacity or 0) < floor]

    def _share(self, tenant: Tenant) -> FairLine[Ticket] | None:
        """The first request: its tenant may have the line to itself. Any other: the line
        becomes a fair one, with whoever waits in it, in their order."""
        if self._solo is None and tenant.max_active is None and tenant.max_queued is None:
            self._solo = tenant
            return None
        fair = self._fair = FairLine(self._hold_ewma_s)
        # What runs now is the solo tenant's: granted in the fair line as if just now, so that
        # it counts against the tenant's limits (a reload may set them) and its release
        # replaces the provisional charge by the real hold, as for any grant.
        for ticket in self._holders:
            fair.granted(ticket)
        for ticket in self._line:
            if not _gone(ticket):
                fair.push(ticket)
        self._line.clear()
        return fair

    def _in_line(self) -> Iterable[Ticket]:
        """Every ticket in the line, those that left included, in a list when fair (so that
        the caller may refuse some as it goes)."""
        return self._line if self._fair is None else list(self._fair.tickets())

    def _may_run(self, fair: FairLine[Ticket], ticket: Ticket) -> bool:
        """Would `ticket`'s tenant stay within its max_active?"""
        limit = ticket.tenant.max_active
        if limit is None:
            return True
        return fair.counts(ticket.tenant.name)[0] + ticket.weight <= limit

    def _check_tenant(self, fair: FairLine[Ticket], ticket: Ticket) -> None:
        """TenantQueueFull when `ticket`'s tenant has its max_queued waiters already."""
        tenant = ticket.tenant
        limit = tenant.max_queued
        if limit is None:
            return
        share = fair.share(tenant.name)
        if share.queued < limit:
            return
        # A place of its own frees when its first waiter is granted: about one slot in as many
        # as there are tenants waiting in its band (or in as many as it has slots to wait for
        # under its own max_active), among the slots that free next.
        turn = fair.busy(tenant.band)
        if tenant.max_active is not None:
            turn = max(turn, (self._capacity or 1) // tenant.max_active)
        snapshot = dataclasses.replace(self.snapshot(), tenant=share)
        raise TenantQueueFull(snapshot, self.retry_after_s(turn + share.queued - limit))

    def _position(self, seq: int) -> int:
        line = self._line
        if not line or seq < line[0].seq:
            return 0
        return min(seq - line[0].seq + 1, self._waiting)

    def _deadline(self, entered_at: float) -> float:
        assert self._queue_timeout_s is not None  # noqa: S101 - only called when set
        loop_now = asyncio.get_running_loop().time()
        return loop_now + self._queue_timeout_s - (time.monotonic() - entered_at)


def _lighter(floor: int, ticket: Ticket) -> bool:
    """Can `ticket` run on an upstream of fewer than `floor` slots?"""
    return ticket.least < floor


def _gone(ticket: Ticket) -> bool:
    future = ticket._future
    return future is None or future.done()
