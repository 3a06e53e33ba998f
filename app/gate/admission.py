"""The admission core: the slots of one or more llama-servers and one bounded line.

Standard library only; it knows nothing of HTTP. One event loop owns an `Admission`: every
method runs on that loop, and the methods that change the pools (`enter`, `Ticket.release`,
`Pool.resize`) are synchronous, so no `await` can split a hand-off between two holders.

Each upstream is a `Pool` of slots (and of KV-cache tokens, when a budget binds); the fleet's
capacity is the sum of the known ones. The line is one for the fleet (app/gate/line.py: first
come first served, or fair between tenants): its head is granted on the pool that
`routing.choose` picks among those with room, and nobody overtakes it on an upstream it could
run on (`_dispatch`). The hold clock (app/gate/clock.py) turns the holds seen into the ETA and
the Retry-After of a refusal.

While the capacity is unknown (llama-server starting or restarting) the pool admits nobody,
but with a startup wait set it still takes requests into the line, up to the last known line
limit (the policy's floor before any), each for at most the startup wait: `resize` to a known
capacity then admits them in arrival order, as any release would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Iterable
from time import monotonic

from slotgate.errors import (
    NotReady,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    TenantQueueFull,
    TenantTooLarge,
    TooLarge,
)
from slotgate.gate.line import FifoLine, Line
from slotgate.gate.policy import BACKFILL_SCAN, QueuePolicy
from slotgate.gate.pool import Pool, Pools, Snapshot
from slotgate.gate.tenants import EVERYONE, Tenant
from slotgate.gate.ticket import Ticket


class Admission(Pools):
    """The pools of a fleet and one line; O(1) per enter, leave and release for one pool and
    one tenant.

    The line starts first come first served (`FifoLine`); the first request of a second
    tenant or band, or of a tenant with limits, makes it fair for good (`FairLine`, through
    `Line.widen`). Either way this class asks the same of it, and the one-tenant hot path
    costs a few method calls on a deque.
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
        super().__init__(epsilon)
        self._policy = policy or QueuePolicy()
        self._queue_timeout_s = queue_timeout_s or None
        # None or 0: refuse at once (NotReady) while the capacity is unknown.
        self._startup_wait_s = startup_wait_s or None
        self._limit: int | None = self._policy.unknown_limit()
        # Waiters that entered while the capacity was unknown and are weighed once it is.
        self._unsized: dict[asyncio.Future[None], Callable[[int], int]] = {}
        self._awaiting_known = 0
        self._line: Line = FifoLine(self._holders)
        # The tenant whose requests leave the line as it is (`Line.solo`), read here so that
        # the one-tenant path does not ask the line on every request.
        self._solo: Tenant | None = None
        self._next_seq = 0
        self._closed = False
        #: An operator paused admission: the line takes requests, nobody is granted slots.
        self._paused = False
        # Closed or paused, in one attribute: the one `enter` reads on its hot path.
        self._halted = False
        if capacity is not None:
            self.resize(capacity)

    # -- reading -----------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._line.queued

    @property
    def queue_limit(self) -> int | None:
        return self._limit

    @property
    def awaiting_capacity(self) -> bool:
        """Somebody waits for a capacity to become known (so it is worth reading often)."""
        return self._line.queued > 0 or self._awaiting_known > 0

    def snapshot(self) -> Snapshot:
        budgets = [pool.budget for pool in self._pools if pool.budget is not None]
        return Snapshot(
            self._capacity,
            self._active,
            self._line.queued,
            self._limit,
            sum(budgets) if budgets else None,
            self.committed_tokens,
        )

    def tenant_counts(self, name: str) -> tuple[int, int]:
        """(slots held, waiters) of the tenant `name`."""
        return self._line.counts(name)

    # -- changing ----------------------------------------------------------------------------

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
        halted = self._halted
        if halted and self._closed:
            raise ShuttingDown(self.snapshot(), self.retry_after_s(1))
        clock = self._clock
        kept = bool(clock.promised) and clock.keep(monotonic())
        if band is not None and band != tenant.band:
            tenant = tenant.lowered(band)
        if tenant is not self._solo:
            self._widen(tenant)
        line = self._line
        capacity = self._capacity
        seq = self._next_seq
        if capacity is None:
            # Nobody is admitted while no capacity is known; with a startup wait, the line
            # still takes requests, weighed once one is (`_weigh_unsized`).
            if self._startup_wait_s is None:
                raise NotReady(self.snapshot(), 1.0)
            self._next_seq = seq + 1
            ticket = Ticket(self, weight, seq, cost, affinity, tenant, conversation, tasks)
        else:
            if weigh is not None:
                # Known since the request was read (a big body's parse outlasted the start).
                weighed = weigh(self._largest)
                if not tasks:
                    weight = weighed
                weigh = None
            if weight > self._largest:
                raise TooLarge(self.snapshot(), weight, self._largest)
            self._next_seq = seq + 1
            ticket = Ticket(self, weight, seq, cost, affinity, tenant, conversation, tasks)
            if tasks:
                weight = ticket.weight = ticket.weighs(self._largest)
            limit = tenant.max_active  # None for the one tenant of a first-come line
            if limit is not None and weight > limit:
                raise TenantTooLarge(self.snapshot(), weight, tenant)
            # Nobody overtakes the line: a free slot goes to a newcomer only when nobody who
            # may run waits (with tenants, one at its max_active may not: `head` passes it
            # over). The sums first: cheap, and with one upstream they settle it (in a fleet
            # one shrunk under what it runs may make them say full while another has room).
            room = self._active + weight <= capacity
            if (
                not halted
                and (room or len(self._pools) > 1)
                and (not line.queued or (room and line.head() is None))
                and (limit is None or line.counts(tenant.name)[0] + weight <= limit)
                # Granted as it enters: the moment it entered is the one clock read it costs.
                and self._grant(ticket, ticket.entered_at)
            ):
                line.granted(ticket)
                ticket.admitted_at = ticket.entered_at
                return ticket
        # A place in the line, if there is one (the line's limit, then its tenant's).
        if self._limit is not None and line.queued >= self._limit:
            raise QueueFull(self.snapshot(), self._promise_s(kept))
        if tenant.max_queued is not None:
            self._check_tenant(ticket)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket._future = future
        line.push(ticket)
        if weigh is not None:
            self._unsized_add(future, weigh)
        elif (
            capacity is not None and len(self._pools) > 1 and self._active < capacity and not halted
        ):
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
        if tenant is not self._solo:
            self._widen(tenant)
        seq = self._next_seq
        self._next_seq = seq + 1
        ticket = Ticket(self, weight, seq, cost, affinity, tenant, conversation)
        self._take(ticket, pool, reason, pool.charge(ticket), ticket.entered_at)
        self._line.granted(ticket)
        if ticket.memo is not None:
            self._remember(ticket.memo, pool)
        ticket.admitted_at = ticket.entered_at
        return ticket

    def retune(self, tenants: Iterable[Tenant]) -> None:
        """Reloaded tenants (API_KEYS_FILE on SIGHUP): their weights and limits from now on."""
        tenants = tuple(tenants)
        line = self._line
        over = line.retune(tenants)
        # None: the next request of anyone may make the line a fair one.
        self._solo = line.solo
        reloaded = {tenant.name: tenant for tenant in tenants}
        for ticket in over:
            # Lowered below what it asks: it could never run.
            tenant = reloaded[ticket.tenant.name]
            self._refuse(ticket, TenantTooLarge(self.snapshot(), ticket.weight, tenant))
        # A limit raised may let a waiter passed over run now.
        self._dispatch()

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Grant nobody slots until `resume`: new requests wait in line (its limit and the
        queue timeout still apply), running ones finish, releases hand nothing on."""
        self._paused = True
        self._halted = True

    def resume(self) -> None:
        """Grant again: the line moves at once, in its order, as far as the slots go."""
        self._paused = False
        self._halted = self._closed
        self._dispatch()

    def close(self) -> None:
        """Take no new work and turn every waiter away (shutdown)."""
        self._closed = True
        self._halted = True
        error = ShuttingDown(self.snapshot(), 1.0)
        for ticket in self._line.drain():
            assert ticket._future is not None  # noqa: S101 - every ticket in line has one
            ticket._future.set_exception(error)

    def turn_away(self, error: Callable[[], BaseException]) -> None:
        """Turn every waiter away with a fresh `error()` (what they wait for will not come: a
        model whose load failed); the line stays open."""
        for ticket in list(self._line.tickets()):
            future = ticket._future
            if future is not None and not future.done():
                self._refuse(ticket, error())

    # -- the line ----------------------------------------------------------------------------

    def _widen(self, tenant: Tenant) -> None:
        """A request of another tenant than the line's only one: the line may turn fair."""
        line = self._line = self._line.widen(tenant, self._holders, self._clock.hold_s)
        self._solo = line.solo

    def _check_tenant(self, ticket: Ticket) -> None:
        """TenantQueueFull when `ticket`'s tenant has its max_queued waiters already."""
        tenant = ticket.tenant
        limit = tenant.max_queued
        assert limit is not None  # noqa: S101 - only called when set
        line = self._line
        share = line.share(tenant.name)
        if share.queued < limit:
            return
        # A place of its own frees when its first waiter is granted: about one slot in as many
        # as there are tenants waiting in its band (or in as many as it has slots to wait for
        # under its own max_active), among the slots that free next.
        turn = line.busy(tenant.band)
        if tenant.max_active is not None:
            turn = max(turn, (self._capacity or 1) // tenant.max_active)
        snapshot = dataclasses.replace(self.snapshot(), tenant=share)
        raise TenantQueueFull(snapshot, self.retry_after_s(turn + share.queued - limit))

    def _refuse(self, ticket: Ticket, error: BaseException) -> None:
        """Turn a waiter away with `error`, out of the line's count at once."""
        assert ticket._future is not None  # noqa: S101 - every ticket in line has one
        ticket._future.set_exception(error)
        self._line.leave(ticket)

    def _leave(self, ticket: Ticket, counted: bool) -> None:
        """A waiter gave up (its future is cancelled or was refused)."""
        if counted:  # one refused was uncounted when refused
            self._line.leave(ticket)
        # The leaver may have been the head that blocked a lighter waiter behind it.
        self._dispatch()

    def _timed_out(self) -> QueueTimeout:
        return QueueTimeout(self.snapshot(), self.retry_after_s(1))

    def _not_ready(self) -> NotReady:
        return NotReady(self.snapshot(), 1.0)

    def _deadline(self, entered_at: float) -> float:
        assert self._queue_timeout_s is not None  # noqa: S101 - only called when set
        loop_now = asyncio.get_running_loop().time()
        return loop_now + self._queue_timeout_s - (monotonic() - entered_at)

    # -- the hand-off ------------------------------------------------------------------------

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

        Synchronous, like every caller: the head is out of the line and its future settled
        before anything else runs, so a slot is never handed to two waiters, and a waiter that
        gives up after this finds its ticket granted and passes the slots on (`release`).
        """
        line = self._line
        capacity = self._capacity
        if capacity is None or not line.queued or self._halted:
            return
        pools = self._pools
        # With one upstream, its being full settles it: nobody fits (in a fleet the sums may
        # say full while an upstream shrunk under what it runs leaves room on another).
        single = len(pools) == 1
        now = monotonic()
        while not (single and self._active >= capacity):
            head = line.head()
            if head is None:
                return
            if not self._grant(head, now):
                if not single:
                    self._backfill(head, now)
                return
            line.grant_head()
            assert head._future is not None  # noqa: S101 - every ticket in line has one
            head._future.set_result(None)

    def _backfill(self, head: Ticket, now: float) -> None:
        """The head waits: grant waiters behind it on the upstreams it can never run on
        (`_dispatch` states the rule). A waiter that does not fit yet keeps the upstreams it
        could use for itself, from everyone behind it: `floor` falls to what it asks."""
        floor = head.least
        line = self._line
        open_ = [p for p in self._pools if p.active < (p.capacity or 0) < floor]
        while open_:
            # Bounded, so that a release behind a long line of heavy waiters stays cheap;
            # those further back wait for the next release.
            ticket = line.first(functools.partial(_lighter, floor), BACKFILL_SCAN)
            if ticket is None:
                return
            if self._route(ticket, open_, now):
                line.take(ticket)
                assert ticket._future is not None  # noqa: S101 - every ticket in line has one
                ticket._future.set_result(None)
            else:
                floor = ticket.least
            open_ = [p for p in open_ if p.active < (p.capacity or 0) < floor]

    def _release(self, ticket: Ticket, pool: Pool, weight: int, hold_s: float | None) -> bool:
        """`ticket` gave back `weight` slots of `pool` after `hold_s`: the head takes them."""
        # Pools' own bookkeeping, inline: this is the hot path of every release.
        self._holders.pop(ticket, None)
        pool.active -= weight
        self._active -= weight
        if pool.retired and not pool.active:
            self._forget(pool)
        if hold_s is not None:
            self._clock.observe(hold_s)
        if not self._line.queued:
            return False  # nobody waits: nothing to hand on (the common case, kept short)
        before = self.admitted_total
        self._dispatch()
        return self.admitted_total != before

    def _reroute(self, ticket: Ticket, pool: Pool, known_by: float) -> None:
        """`Ticket.reroute`: its slots back, and the ticket at the head of the line again."""
        ticket.admitted_at = None
        ticket.pool = None
        pool.committed -= ticket.charged
        ticket.charged = 0
        ticket.rerouted = True
        ticket._known_by = known_by
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ticket._future = future
        weight = ticket.weight
        line = self._line
        line.released(ticket, None)
        if ticket.tasks:
            # Its next upstream may have more slots than this one: llama-server fills them.
            ticket.weight = ticket.weighs(self._largest)
            limit = ticket.tenant.max_active
            if limit is not None and ticket.weight > limit:
                future.set_exception(TenantTooLarge(self.snapshot(), ticket.weight, ticket.tenant))
                self._release(ticket, pool, weight, None)
                return
        # Admitted before everybody still waiting, so its place is the head (of its band).
        line.push_front(ticket)
        self._release(ticket, pool, weight, None)

    # -- what a change to the pools does to the line (hooks of Pools) ------------------------

    def _refit(self) -> None:
        """A capacity is known: the line's limit, the waiters weighed again, then whoever fits."""
        capacity = self._capacity
        largest = self._largest
        assert capacity is not None  # noqa: S101 - called once one is known
        self._limit = self._policy.limit(capacity)
        if self._unsized:
            self._weigh_unsized(largest)
        # An upstream away may come back with as many slots as before: a waiter that only it
        # fits is told to retry (503), not to ask for less (400).
        likely = max([pool.seen for pool in self._pools if not pool.retired], default=0)
        for ticket in list(self._line.tickets()):
            future = ticket._future
            if future is None or future.done():
                continue
            if ticket.tasks:
                # A prompt array fills as many slots as its upstream has, now more or fewer.
                ticket.weight = ticket.weighs(largest)
            limit = ticket.tenant.max_active
            if ticket.least > largest:
                if ticket.least <= likely:
                    self._refuse(ticket, NotReady(self.snapshot(), self.retry_after_s(1)))
                else:
                    self._refuse(ticket, TooLarge(self.snapshot(), ticket.least, largest))
            elif limit is not None and ticket.weight > limit:
                self._refuse(ticket, TenantTooLarge(self.snapshot(), ticket.weight, ticket.tenant))
        self._dispatch()

    def _uncost(self) -> None:
        """Waiters already in line came at no cost: what they take is unknown, so each is
        charged the whole budget of the pool it gets."""
        for ticket in self._line.tickets():
            ticket.costed = False

    # -- the capacity-unknown path ------------------------------------------------------------

    def _unsized_add(self, future: asyncio.Future[None], weigh: Callable[[int], int]) -> None:
        """The waiter of `future` is weighed by `weigh` once a capacity is known."""
        unsized = self._unsized
        if len(unsized) > 2 * self._line.queued + 64:  # leavers', pruned amortised O(1)
            self._unsized = unsized = {f: w for f, w in unsized.items() if not f.done()}
        unsized[future] = weigh

    def _weigh_unsized(self, largest: int) -> None:
        """A capacity is known: weigh whoever entered without one, in place in the line."""
        unsized, self._unsized = self._unsized, {}
        for ticket in list(self._line.tickets()):
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
                self._refuse(ticket, exc)


def _lighter(floor: int, ticket: Ticket) -> bool:
    """Can `ticket` run on an upstream of fewer than `floor` slots?"""
    return ticket.least < floor
