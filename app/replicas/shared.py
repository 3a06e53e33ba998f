"""Admission shared by several replicas through Redis or Valkey: one pool per upstream and one
bounded line, whichever replica a request came to.

The state lives in Redis (app/replicas/lua/__init__.py lists the keys) and changes only inside
server-side scripts, so that every decision (a free slot, a place in the line, the line bound,
the hand-off to the head of the line) is one atomic step, and taking a free slot is one round
trip. A release hands the slots to the head of the line inside the same script and publishes the
grant on the waiter's replica's channel: one subscription per replica, no polling, no other
waiter woken.

The line is a sorted set ordered by band (a higher band first), then a tag, then the arrival
number. The script computes the tag: for a named tenant, its virtual start time under start-time
fair queuing over slot-seconds (app/replicas/lua/__init__.py says how), so that tenants share
the slots by their shares across the replicas; without a tenant, the arrival number itself, so
the order is exact FIFO. A tenant's `max_queued` is checked and its `max_active` kept inside the
scripts too, and each upstream's KV-cache token budget as in app/gate/admission.py's `Pool`.

When Redis is unreachable or slow (no answer within `timeout_s`), the replica is degraded
(membership.py says what it does then, and how it rejoins).

Everything runs on one event loop; local bookkeeping changes only synchronously. The parts:
this replica's tickets and what it asks of Redis (here), a request's ENTER and what its reply
means (arrival.py), the heartbeat, falling back and rejoining (membership.py), the calls to
Redis (transport.py), the gating on a share while Redis is away (alone.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slotgate.errors import (
    Down,
    ShuttingDown,
    Stale,
    TooLarge,
)
from slotgate.gate.clock import HOLD_EWMA_ALPHA, INITIAL_HOLD_S, ewma, retry_after
from slotgate.gate.entry import Entry
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.pool import Snapshot
from slotgate.gate.tenants import EVERYONE
from slotgate.replicas.alone import Alone
from slotgate.replicas.arrival import Arrival
from slotgate.replicas.lua import unset
from slotgate.replicas.membership import Membership
from slotgate.replicas.ticket import Figures, Mode, SharedTicket, name_of
from slotgate.replicas.transport import Transport, stop

#: Redis keeps a silent replica's grants this many REDIS_TTLs after its heartbeat expired.
KEPT_TTLS = 10


@dataclass(frozen=True, slots=True)
class SharedSnapshot:
    mode: Mode
    fleet: Figures
    #: This replica's part: slots it holds and requests of its own in the line.
    active: int
    queued: int
    #: The capacities this replica's own followers see.
    capacities: dict[str, int] = field(default_factory=dict)
    fallbacks: int = 0


class SharedAdmission:
    """The admission of one replica among several sharing a fleet through Redis."""

    def __init__(
        self,
        url: str,
        fleet: str = "default",
        *,
        replica: str | None = None,
        policy: QueuePolicy | None = None,
        epsilon: float = 1.0,
        queue_timeout_s: float | None = None,
        timeout_s: float = 0.25,
        heartbeat_s: float = 1.0,
        ttl_s: float = 3.0,
        failure_mode: str = "local",
        max_connections: int = 32,
        kept_s: float | None = None,
    ) -> None:
        if failure_mode not in ("local", "reject"):
            raise ValueError(f"failure_mode must be local or reject, got {failure_mode!r}")
        prefix = f"slotgate:{{{fleet}}}:"
        self.replica = replica or f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(3)}"
        self._policy = policy or QueuePolicy()
        self._epsilon = epsilon
        self._queue_timeout_s = queue_timeout_s
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._ttl_ms = round(ttl_s * 1000)
        #: How long Redis keeps counting this replica's grants once it gave the replica up.
        self._kept_ms = round((KEPT_TTLS * ttl_s if kept_s is None else kept_s) * 1000)
        self._failure_mode = failure_mode
        self._redis = Transport(
            url, prefix, f"{prefix}ch:{self.replica}", timeout_s=timeout_s,
            max_connections=max_connections, shared=lambda: self.mode is Mode.SHARED,
        )  # fmt: skip
        self.mode = Mode.DEGRADED
        self.fallbacks_total = 0
        #: Why Redis was last found unusable.
        self.last_error = ""
        self._fleet = Figures()
        #: Told of a KV budget another replica learned for an upstream (upstream, tokens).
        self.on_budget: Callable[[str, int], None] | None = None
        self._capacities: dict[str, int] = {}
        self._budgets: dict[str, int] = {}
        self._ids = itertools.count(1)
        #: Every live ticket of this replica, by id; waiters in arrival order (dicts keep it).
        self._tickets: dict[str, SharedTicket] = {}
        self._waiters: dict[str, SharedTicket] = {}
        #: Grants that arrived before the reply that named their member.
        self._early: dict[str, tuple[str, str, int, int]] = {}
        #: An operator paused this replica's admission: degraded, its core grants nobody.
        self.paused = False
        #: Degraded mode's gating, on this replica's share.
        self._alone = Alone(self)
        #: Its heartbeat, the grants' channel, falling back and rejoining.
        self._link = Membership(self)
        #: A request's ENTER, and what its reply means.
        self._arrival = Arrival(self)
        #: When (time.monotonic()) the last heartbeat that Redis took was sent.
        self._renewed_at: float | None = None
        self._hold_ewma_s = INITIAL_HOLD_S
        #: The last grant number this replica was given (the fleet's count, see `_grants`).
        self._last_grant = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending: set[asyncio.Task[Any]] = set()
        self._shared = asyncio.Event()  # set while in shared mode
        self._joining: asyncio.Future[None] | None = None
        #: Changes at every degrade and rejoin: an answer from an older epoch is stale.
        self._epoch = 0
        self._keeper: asyncio.Task[None] | None = None
        self._closed = False

    # -- life ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the fleet (or start degraded, if Redis does not answer); keep the heartbeat."""
        with contextlib.suppress(Down):
            await self._link.join()
        self._keeper = asyncio.create_task(self._link.keep(), name="slotgate-shared-heartbeat")

    async def close(self) -> None:
        """Take no new work, refuse every waiter, hand back what Redis counts for this replica;
        within a few `timeout_s` whatever Redis does (what does not reach it, Redis takes back
        when this replica's lease runs out)."""
        self._closed = True
        for ticket in list(self._waiters.values()):
            self._fail(ticket, ShuttingDown(self._snapshot(), 1.0))
        # Waited on, not awaited: a Redis call may turn the cancellation into an error, and
        # the task goes on (it stops at its next turn, having seen `_closed`).
        await stop((self._keeper, self._redis.listener), self._timeout_s)
        await self.settle(self._timeout_s)
        for task in self._pending:
            task.cancel()  # a release still waiting for a connection: RETIRE covers it
        if self.mode is Mode.SHARED:
            with contextlib.suppress(Down, TimeoutError):
                # A connection (the releases left give theirs back at once), then the call.
                async with asyncio.timeout(2 * self._timeout_s):
                    await self._call("RETIRE", self.replica, self._epsilon)
        await self._redis.aclose()

    async def settle(self, within_s: float | None = None) -> None:
        """Until the releases already made have reached Redis (or failed), or `within_s`."""
        deadline = None if within_s is None else time.monotonic() + within_s
        while self._pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            await asyncio.wait(list(self._pending), timeout=left)

    def pause(self, paused: bool) -> None:
        """Hold (or let go) degraded mode's gating: its core grants nobody while paused, and
        moves its line once resumed. Shared mode's part is the replica's (ReplicaAdmission)."""
        self.paused = paused
        if paused:
            self._alone.core.pause()
        else:
            self._alone.core.resume()

    # -- reading -----------------------------------------------------------------------------

    def snapshot(self) -> SharedSnapshot:
        return SharedSnapshot(
            self.mode,
            self._fleet,
            sum(t.weight for t in self._tickets.values() if t.granted),
            len(self._waiters),
            dict(self._capacities),
            self.fallbacks_total,
        )

    def _snapshot(self) -> Snapshot:
        """The fleet as the local core's Snapshot, for the errors the HTTP layer maps."""
        fleet = self._fleet
        if self.mode is Mode.DEGRADED:
            return self._alone.snapshot()
        return Snapshot(fleet.capacity or None, fleet.active, fleet.queued, self._limit())

    def _known(self) -> bool:
        """Is any upstream's capacity known (here, or to the fleet at the last heartbeat)?"""
        return bool(self._capacities) or (self.mode is Mode.SHARED and self._fleet.capacity > 0)

    def _grants(self) -> int:
        """The fleet's grants so far, as last heard."""
        return max(self._fleet.granted, self._last_grant)

    def _limit(self) -> int | None:
        return self._policy.limit(self._fleet.capacity) if self._fleet.capacity else None

    def _retry_after_s(self, position: int) -> float:
        capacity = self._snapshot().capacity or 1
        hold = self._fleet.hold_s if self._fleet.hold_s is not None else self._hold_ewma_s
        return retry_after(hold * position / capacity)

    # -- changing --------------------------------------------------------------------------

    async def resize(
        self,
        upstream: str,
        capacity: int | None,
        *,
        budget: int | None = None,
        learned: bool = True,
    ) -> None:
        """Follow one upstream's slot count as this replica's follower sees it (None: unknown),
        and its KV-cache budget in tokens (None, or not positive: it does not bind; unless
        not `learned`: this replica knows none yet, and one another replica told stays)."""
        if capacity is None:
            self._capacities.pop(upstream, None)
        else:
            self._capacities[upstream] = capacity
        if budget is not None and budget > 0:
            self._budgets[upstream] = budget
        else:
            self._budgets.pop(upstream, None)
            budget = None
        if self.mode is Mode.SHARED:
            try:
                unbudgeted = "" if learned else "?"
                await self._call(
                    "RESIZE", upstream, "" if capacity is None else capacity, self._epsilon,
                    unbudgeted if budget is None else budget,
                )  # fmt: skip
            except Down as exc:
                self._link.degrade(str(exc))
            return
        if self._joining is None:  # else after the rejoin, should it fail
            self._alone.dispatch()

    async def rekey(self, old: str, new: str) -> None:
        """An upstream is known by another name now: what this replica holds there is held
        under `new`, here and in Redis, and `old` is unknown (`resize` `new` after this)."""
        self._capacities.pop(old, None)
        self._budgets.pop(old, None)
        for ticket in self._tickets.values():
            if ticket.upstream == old:
                ticket.upstream = new
        self._alone.rekey(old, new)
        if self.mode is Mode.SHARED:
            try:
                await self._call("REKEY", self.replica, old, new)
            except Down as exc:
                # The rejoin registers the grants under their new name.
                self._link.degrade(str(exc))

    async def retune(self, tenant: str, share: float, max_active: int | None) -> None:
        """A tenant's share and max_active reloaded: its waiters, here and in Redis, take
        them (a raised max_active lets them run on free slots at once)."""
        if share <= 0:
            raise ValueError(f"share must be positive, got {share}")
        tenant = name_of(tenant)
        for ticket in self._waiters.values():
            if ticket.tenant == tenant:
                ticket.share, ticket.max_active = share, max_active
        self._alone.retune(tenant, share, max_active)
        if self.mode is Mode.SHARED:
            try:
                await self._call("RETUNE", tenant, repr(share), unset(max_active), self._epsilon)
            except Down as exc:
                self._link.degrade(str(exc))

    async def enter(
        self, entry: Entry, ranking: Sequence[str] = (), tag: float | None = None
    ) -> SharedTicket:
        """Take `entry.weight` slots on one upstream now, or a place in the line, or raise why
        not. The entry is the core's (app/gate/entry.py), and means what it means there: a
        higher band is served first; inside a band, named tenants by their weight (share of
        slot time), each FIFO, or FIFO without a tenant (`EVERYONE`), within the tenant's own
        `max_active` (slots) and `max_queued` (places); a prompt array holds as many slots as
        it has tasks, up to those of the upstream that grants it; `affinity` and `conversation`
        route it on this replica's own core while Redis is away.

        `ranking` is the request's upstreams by affinity, best first (empty: a free slot drawn
        evenly); `tag` overrides the order inside the band (lower first).
        """
        weight, cost, _, affinity, tenant, band, conversation, tasks = entry
        if self._closed:
            raise ShuttingDown(self._snapshot(), 1.0)
        if tenant.weight <= 0:
            raise ValueError(f"share must be positive, got {tenant.weight}")
        named = tenant is not EVERYONE
        if named and tenant.max_active is not None and weight > tenant.max_active:
            # Its tenant may never hold that many slots at once: it could never run.
            raise TooLarge(self._snapshot(), weight, tenant.max_active)
        order = next(self._ids)
        ticket = SharedTicket(
            self, f"{self.replica}.{order}", order, weight, cost, tuple(ranking),
            tenant.band if band is None else band, tag, name_of(tenant.name) if named else "",
            tenant.weight, tenant.max_active, tenant.max_queued, tasks, affinity, conversation,
        )  # fmt: skip
        stale = 0
        while True:
            # Never into the local line while a rejoin runs: its list would miss the ticket.
            if self._joining is not None:
                await asyncio.shield(self._joining)
                continue
            if self.mode is not Mode.SHARED or stale > 2:
                break
            try:
                return await self._arrival.enter(ticket)
            except Down as exc:
                self._link.degrade(str(exc))
            except Stale:
                stale += 1
        return self._alone.enter(ticket)

    def _granted(
        self, ticket: SharedTicket, upstream: str, reason: str, grant_no: int, weight: int
    ) -> None:
        ticket.upstream = upstream
        ticket.weight = weight
        ticket.reason = reason
        ticket.grant_no = grant_no
        ticket.position = 0
        self._last_grant = max(self._last_grant, grant_no)
        ticket.admitted_at = time.monotonic()
        self._waiters.pop(ticket.id, None)
        future = ticket._future
        if future is not None and not future.done():
            future.set_result(None)

    def _fail(self, ticket: SharedTicket, error: Exception) -> None:
        self._waiters.pop(ticket.id, None)
        self._tickets.pop(ticket.id, None)
        ticket._released = True
        future = ticket._future
        if future is not None and not future.done():
            future.set_exception(error)
        self._alone.free(ticket)
        if ticket.member is not None and self.mode is Mode.SHARED:
            self._spawn(self._release_shared(ticket.member, None))

    def _drop(self, ticket: SharedTicket) -> None:
        """A ticket is done with: forget it here, and in Redis if Redis knows it."""
        self._tickets.pop(ticket.id, None)
        self._waiters.pop(ticket.id, None)
        hold_s = None
        if ticket.granted and ticket.admitted_at is not None:
            hold_s = time.monotonic() - ticket.admitted_at
            self._hold_ewma_s = ewma(self._hold_ewma_s, hold_s)
        if self.mode is Mode.SHARED and ticket.member is not None:
            self._spawn(self._release_shared(ticket.member, hold_s))
            return
        # Degraded (or rejoining: the rejoin's list no longer has it, and Redis forgets it).
        self._alone.free(ticket)

    def _reroute(self, ticket: SharedTicket) -> None:
        ticket.upstream = None
        ticket.reason = ""
        ticket.grant_no = 0
        ticket.admitted_at = None
        ticket._future = asyncio.get_running_loop().create_future()
        ticket.order = 0  # the head of this replica's own line, should it gate alone
        self._waiters[ticket.id] = ticket
        if self.mode is Mode.SHARED and self._joining is None and ticket.member is not None:
            ticket.weight = ticket.least  # weighed again where it is granted next
            self._spawn(self._reroute_shared(ticket, ticket.member))
            return
        # Degraded, or a rejoin runs (it finds the ticket no longer granted: `_rejoin`).
        ticket.weight = ticket.least  # weighed again where it is granted next
        self._alone.reroute(ticket)

    async def _reroute_shared(self, ticket: SharedTicket, member: str) -> None:
        try:
            await self._call("REROUTE", self.replica, member, self._epsilon)
        except Down as exc:
            # It waits in this replica's line now; the rejoin lists it as a waiter.
            self._link.degrade(str(exc))
        # 'none': Redis does not know the grant, so it gave this replica up; the heartbeat
        # finds it fenced and the rejoin lists the ticket as a waiter.

    async def _release_shared(self, member: str, hold_s: float | None) -> None:
        try:
            await self._call(
                "RELEASE", self.replica, member, "" if hold_s is None else repr(hold_s),
                self._epsilon, HOLD_EWMA_ALPHA,
            )  # fmt: skip
        except Down as exc:
            # Redis forgets it when this replica rejoins: the rejoin lists only what it holds.
            self._link.degrade(str(exc))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- Redis -------------------------------------------------------------------------------

    async def _call(self, name: str, *args: str | int | float) -> Any:
        # A burst waits here for a connection, outside the timeout: only Redis's own answer is
        # timed, so that a burst is not taken for a slow Redis. A call still waiting when the
        # replica has fallen back gives up at once rather than try a Redis known to be away.
        epoch = self._epoch
        async with self._redis.calls:
            if self._epoch != epoch and self.mode is Mode.DEGRADED:
                raise Down(f"{name}: fell back while waiting for a connection")
            return await self._redis.script(name, args)


__all__ = [
    "Down",
    "Figures",
    "Mode",
    "SharedAdmission",
    "SharedSnapshot",
    "SharedTicket",
]
