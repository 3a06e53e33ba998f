"""The pools of the admission core: one per upstream (its slots and its KV-cache budget),
and `Pools`, the fleet of them: their sums, who holds what, and which one a ticket runs on."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slotgate.gate.clock import HoldClock, retry_after
from slotgate.gate.routing import choose, stable_hash

if TYPE_CHECKING:
    from slotgate.gate.fairline import Share
    from slotgate.gate.ticket import Ticket

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


class Pool:
    """One upstream's slots and KV-cache budget in the fleet; its capacity is None while the
    upstream is not ready (starting, restarting, down), and then nothing is routed to it."""

    __slots__ = (
        "_admission", "active", "budget", "capacity", "committed", "draining", "key", "reported",
        "retired", "routed", "salt", "seen",
    )  # fmt: skip

    def __init__(self, admission: Pools, key: str) -> None:
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
        #: An operator drained it: its running requests finish, nothing new is granted on it,
        #: and its slots leave the fleet's capacity until `restore`.
        self.draining = False
        #: The capacity its upstream last reported, drained or not: what `restore` gives back.
        self.reported: int | None = None

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
        self.reported = capacity
        if self.retired or self.draining:
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
        self.budget = budget_tokens if budget_tokens is not None and budget_tokens > 0 else None
        self._admission._rebudgeted(self)

    def drain(self) -> None:
        """Take it out of rotation (maintenance): held as an upstream that is not ready, so
        nothing new is routed to it and its slots leave the capacity, while the requests it
        runs finish and release as ever. Its upstream's readings still arrive (`reported`)."""
        if self.draining:
            return
        reported = self.reported
        self.draining = True
        self.resize(None)
        self.reported = reported

    def restore(self) -> None:
        """Back in rotation with the capacity its upstream last reported."""
        if not self.draining:
            return
        self.draining = False
        self.resize(self.reported)

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


class Pools:
    """The pools of a fleet: their summed capacity, their budgets, who holds slots of them
    and so when slots free (the hold clock), and which one a ticket runs on (routing). The
    admission core builds its line on this; the hooks at the end are where a change to the
    pools reaches the line."""

    def __init__(self, epsilon: float) -> None:
        self._epsilon = epsilon
        self._pools: list[Pool] = []
        self._capacity: int | None = None
        self._largest = 0  # the most slots of one known pool: a request's weight bound
        self._active = 0
        # Who holds slots (ticket: when granted, weight), in the order granted, for `eta_s`.
        self._holders: dict[Ticket, tuple[float, int]] = {}
        # Where each affinity key's last request ran (its prompt is cached there now), the
        # newest last; bounded, the oldest forgotten first.
        self._last: OrderedDict[int, Pool] = OrderedDict()
        self._budgeted = False  # a KV-cache budget binds on some pool
        # The largest of them: no request takes more, since it runs on one upstream.
        self._largest_budget: int | None = None
        #: Told of every change to a pool's capacity, budget or name (the shared line through
        #: Redis follows them: app/replicas/replica.py).
        self.on_change: Callable[[Pool], None] | None = None
        self.admitted_total = 0
        self._clock = HoldClock()

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

    def bounds(self) -> tuple[int | None, int | None, bool]:
        """`largest`, `budget_tokens` and `cold` in one call: what a request's intake reads
        of the pools, on every request (three properties cost three calls)."""
        return self._largest or None, self._largest_budget, self._clock.cold

    @property
    def budget_tokens(self) -> int | None:
        """The largest budget of one pool (what a request's cost is cut to), None if none binds."""
        return self._largest_budget

    @property
    def committed_tokens(self) -> int:
        return sum(pool.committed for pool in self._pools)

    def last_pool(self, memo: int) -> Pool | None:
        """The pool that ran the last request of this conversation (or affinity key): its
        prompt is cached there."""
        return self._last.get(memo)

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

    # -- when slots free (the hold clock) ----------------------------------------------------

    @property
    def hold_estimate_s(self) -> float:
        return self._clock.hold_s

    @property
    def cold(self) -> bool:
        """No hold has been observed yet: the estimate rests on `expect`, if anything."""
        return self._clock.cold

    def retry_after_s(self, position: int) -> float:
        """When a slot could be free for the `position`-th request from now, in seconds
        (`eta_s`), clamped so that clients neither hammer the gate nor give up."""
        return retry_after(self.eta_s(position))

    def eta_s(self, position: int) -> float:
        """When the `position`-th slot to free from now should free, in seconds
        (`HoldClock.eta_s`)."""
        return self._clock.eta_s(position, self._capacity, self._active, self._holders.values())

    def estimate_s(self) -> float:
        """The Retry-After a request refused now would be told (`HoldClock.promise_s`, without
        its random part and without promising it), for /admission."""
        return self._clock.promise_s(self._capacity, self._holders.values(), record=False)

    def expect(self, hold_s: float) -> None:
        """A request about to enter should hold its slots about `hold_s` (`HoldClock.expect`)."""
        self._clock.expect(hold_s)

    def _promise_s(self, kept: bool = False) -> float:
        return self._clock.promise_s(self._capacity, self._holders.values(), kept)

    # -- where a ticket runs -----------------------------------------------------------------

    def _grant(self, ticket: Ticket, now: float) -> bool:
        """Give `ticket` its slots on the pool routing picks, if any has room for it now
        (`now`: time.monotonic(), read once by the caller)."""
        pools = self._pools
        if len(pools) == 1:
            # One upstream: nothing to choose, and the hot path stays as short as it was (an
            # array's weight is this pool's already: `_resized` weighs every waiter again).
            pool = pools[0]
            charge = pool.charge(ticket)
            if not pool.fits(ticket.weight, charge):
                return False
            first = ticket.affinity is not None
            reason = "retry" if ticket.rerouted else "affinity" if first else "load"
            self._take(ticket, pool, reason, charge, now)
            return True
        return self._route(ticket, pools, now)

    def _route(self, ticket: Ticket, pools: list[Pool], now: float) -> bool:
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
        reason = "retry" if ticket.rerouted else "affinity" if first else "load"
        self._take(ticket, pool, reason, pool.charge(ticket), now)
        return True

    def _take(self, ticket: Ticket, pool: Pool, reason: str, charge: int, now: float) -> None:
        """`ticket` holds its slots and `charge` tokens of `pool` (`pool.charge(ticket)`, which
        the caller has at hand) from `now` on."""
        pool.active += ticket.weight
        pool.committed += charge
        pool.routed[reason] += 1
        ticket.pool = pool
        ticket.charged = charge
        self._holders[ticket] = (now, ticket.weight)
        self._active += ticket.weight
        self.admitted_total += 1

    def _remember(self, key: int, pool: Pool) -> None:
        last = self._last
        last[key] = pool
        last.move_to_end(key)
        if len(last) > AFFINITY_MEMORY:
            last.popitem(last=False)

    # -- changes to the pools (called by Pool) -----------------------------------------------

    def _only(self) -> Pool:
        pools = self._pools
        if not pools:
            return self.add_pool("upstream")
        if len(pools) > 1:
            raise RuntimeError("several pools: resize each one (Pool.resize)")
        return pools[0]

    def _resized(self) -> None:
        """A pool's capacity changed: the fleet's sums, then the line (`_refit`)."""
        known = [pool.capacity for pool in self._pools if pool.capacity is not None]
        if not known:
            # The line keeps the last known limit while every upstream is away.
            self._capacity = None
            self._largest = 0
            return
        self._capacity = sum(known)
        self._largest = max(known)
        self._refit()

    def _rebudgeted(self, pool: Pool) -> None:
        """A pool's KV-cache budget changed (`Pool.resize_budget`)."""
        if pool.budget is not None and not self._budgeted:
            self._uncost()
        budgets = [pool.budget for pool in self._pools if pool.budget is not None]
        self._budgeted = bool(budgets)
        self._largest_budget = max(budgets) if budgets else None
        self._dispatch()
        self._notify(pool)

    def _forget(self, pool: Pool) -> None:
        """Drop retired pools that nobody holds slots of any more."""
        self._pools = [p for p in self._pools if not (p.retired and p.active == 0)]

    def _notify(self, pool: Pool) -> None:
        if self.on_change is not None:
            self.on_change(pool)

    # -- hooks for the line (app/gate/admission.py) ------------------------------------------

    @property
    def awaiting_capacity(self) -> bool:
        """Somebody waits for a capacity to become known."""
        raise NotImplementedError

    def _refit(self) -> None:
        """A capacity is known (again, or another): fit the line to it and let it move."""
        raise NotImplementedError

    def _uncost(self) -> None:
        """A budget binds for the first time: what the waiters take of it is unknown."""
        raise NotImplementedError

    def _dispatch(self) -> None:
        """Room may have freed: grant whoever fits now."""
        raise NotImplementedError
