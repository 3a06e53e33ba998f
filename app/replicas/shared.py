"""Admission shared by several replicas through Redis or Valkey: one pool per upstream and one
bounded line, whichever replica a request came to.

The state lives in Redis (app/replicas/lua.py lists the keys) and changes only inside server-side
scripts, so that every decision (a free slot, a place in the line, the line bound, the hand-off
to the head of the line) is one atomic step, and taking a free slot is one round trip. A
release hands the slots to the head of the line inside the same script and publishes the grant
on the waiter's replica's channel: one subscription per replica, no polling, no other waiter
woken.

The line is a sorted set ordered by band (a higher band first), then a tag, then the arrival
number. The script computes the tag: for a named tenant, its virtual start time under
start-time fair queuing over slot-seconds (app/replicas/lua.py says how), so that tenants share
the slots by their shares across the replicas; without a tenant, the arrival number itself, so
the order is exact FIFO. A tenant's `max_queued` is checked and its `max_active` kept inside
the scripts too, and each upstream's KV-cache token budget as in app/gate/admission.py's `Pool`.

When Redis is unreachable or slow (no answer within `timeout_s`), the replica is degraded:
with `failure_mode="local"` it gates alone on a static share of each upstream (its slots divided
by the replicas last seen, at least 1) and of the line; with "reject" it refuses new work with
`NotReady` (503). A share is safe only if Redis is away for every replica (it refused or closed
a connection). One that merely gets no answer may be cut off alone while the others fill every
slot Redis does not count for it: so Redis keeps a given-up replica's grants counted for
`kept_s` past its heartbeat's expiry, and until then (by its own clock, from the last heartbeat
Redis took) the replica gates only on the slots it held when it fell back.
It pings Redis meanwhile and, once Redis answers, replaces whatever Redis
holds for it with what it holds (`REJOIN`): its grants and, at the back of the line in their
order, its waiters. The same happens when Redis says it gave this replica up (its heartbeat
expired): Redis never counts what the replica no longer holds, and never loses what it still
does. Alone, a replica gates FIFO on slots only: tenants' shares and limits and the token
budgets hold in shared mode.

Everything runs on one event loop; local bookkeeping changes only synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import math
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from slotgate.gate.admission import (
    NotReady,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    TenantQueueFull,
    TooLarge,
)
from slotgate.gate.clock import HOLD_EWMA_ALPHA, INITIAL_HOLD_S, ewma, retry_after
from slotgate.gate.fairline import Share
from slotgate.gate.line import QueuePolicy
from slotgate.gate.pool import Snapshot
from slotgate.replicas import lua as shared_lua

#: Redis keeps a silent replica's grants this many REDIS_TTLs after its heartbeat expired.
KEPT_TTLS = 10


class Mode(enum.Enum):
    SHARED = "shared"
    #: Redis is away; the replica gates on its share (or refuses, with failure_mode "reject").
    DEGRADED = "degraded"


class Down(Exception):
    """Redis did not answer in time, or not at all."""


class Stale(Exception):
    """An answer from before a degrade or a rejoin: what it gave, the rejoin took back."""


@dataclass(frozen=True, slots=True)
class Fleet:
    """What Redis last said of the whole fleet."""

    capacity: int = 0
    active: int = 0
    queued: int = 0
    hold_s: float | None = None
    replicas: int = 1
    #: Grants made so far, fleet-wide.
    granted: int = 0

    @classmethod
    def parse(cls, raw: Sequence[bytes]) -> Fleet:
        hold = float(raw[3])
        return cls(
            int(raw[0]), int(raw[1]), int(raw[2]), hold if hold >= 0 else None, int(raw[4]),
            int(raw[5]),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SharedSnapshot:
    mode: Mode
    fleet: Fleet
    #: This replica's part: slots it holds and requests of its own in the line.
    active: int
    queued: int
    #: The capacities this replica's own followers see.
    capacities: dict[str, int] = field(default_factory=dict)
    fallbacks: int = 0


class SharedTicket:
    """One request's claim; `async with ticket:` releases it on every way out."""

    __slots__ = (
        "_admission", "_future", "_known_by", "_released", "admitted_at", "band", "cost",
        "entered_at", "grant_no", "id", "least", "max_active", "max_queued", "member", "order",
        "position", "ranking", "reason", "rerouted", "share", "since", "tag", "tasks",
        "tenant", "upstream", "weight",
    )  # fmt: skip

    def __init__(
        self,
        admission: SharedAdmission,
        id: str,
        order: int,
        weight: int,
        cost: int,
        ranking: Sequence[str],
        band: int,
        tag: float | None,
        tenant: str = "",
        share: float = 1.0,
        max_active: int | None = None,
        max_queued: int | None = None,
        tasks: int = 0,
    ) -> None:
        self._admission = admission
        self.id = id
        #: This replica's own arrival number: the order of its waiters when they rejoin.
        self.order = order
        #: The fewest slots it runs in; a prompt array's tasks (0 for any other request). The
        #: slots it holds (`weight`) are known once granted: its least until then.
        self.least = weight
        self.tasks = tasks
        self.weight = weight
        self.cost = cost
        self.ranking = tuple(ranking)
        self.band = band
        self.tag = tag
        # Tabs and newlines separate the fields of a ticket in Redis.
        self.tenant = tenant.replace("\t", " ").replace("\n", " ")
        self.share = share
        self.max_active = max_active
        self.max_queued = max_queued
        #: Its 1-based place in the fleet's line as last known (the ENTER reply's); 0 once
        #: granted.
        self.position = 0
        #: The fleet's grants so far when `position` was read: each grant since moves it up.
        self.since = 0
        #: `<seq>|<id>` while Redis knows the ticket; a new one each time it (re)joins.
        self.member: str | None = None
        self.upstream: str | None = None
        self.reason = ""
        #: The grant's place among all grants of the fleet (0: granted locally).
        self.grant_no = 0
        self.entered_at = time.monotonic()
        self.admitted_at: float | None = None
        self._future: asyncio.Future[None] | None = None
        self._released = False
        #: Sent back by its upstream (`reroute`), and until when it may wait for one known.
        self.rerouted = False
        self._known_by: float | None = None

    def weighs(self, capacity: int) -> int:
        """The slots it holds on an upstream of `capacity` (as the core's Ticket.weighs)."""
        tasks = self.tasks
        return self.least if not tasks else max(self.least, min(tasks, capacity))

    @property
    def seq(self) -> int:
        """The fleet-wide arrival number (0 when Redis never saw the ticket)."""
        return int(self.member.split("|", 1)[0], 16) if self.member else 0

    @property
    def granted(self) -> bool:
        return self.upstream is not None

    @property
    def place(self) -> int:
        """Its 1-based place in the fleet's line now (0 once granted or never placed): its
        place when it entered, less the fleet's grants since, as this replica last heard of
        them (its own grants at once, the others' at each heartbeat). Exact for one FIFO line
        but for leavers ahead of it; an estimate under fair share."""
        if self.granted or not self.position:
            return 0
        served = self._admission._grants() - self.since
        return max(self.position - max(served, 0), 1)

    async def wait(self) -> None:
        """Wait for the slots; on any exit without them, leave the line at once."""
        if self.granted or self._future is None:
            return
        admission = self._admission
        try:
            if self.rerouted:
                await self._wait_rerouted(self._future)
            elif admission._queue_timeout_s is None:
                await self._future
            else:
                async with asyncio.timeout(
                    admission._queue_timeout_s - (time.monotonic() - self.entered_at)
                ):
                    await self._future
        except BaseException as exc:
            self.release()
            if isinstance(exc, TimeoutError):
                raise QueueTimeout(admission._snapshot(), admission._retry_after_s(1)) from None
            raise
        self.admitted_at = time.monotonic()

    async def _wait_rerouted(self, future: asyncio.Future[None]) -> None:
        # Sent back by its upstream: it waits at the head of the line, not under the queue
        # timeout again, but only while some upstream is known (or until `known_by`).
        known_by = self._known_by
        if known_by is not None:
            admission = self._admission
            await asyncio.wait((future,), timeout=max(known_by - time.monotonic(), 0.0))
            # The fleet's capacity it goes by is the last heartbeat's, which may predate the
            # refusal: look again at each heartbeat, so that a line no upstream serves any more
            # refuses it rather than keep it forever.
            while not future.done():
                if not admission._known():
                    raise NotReady(admission._snapshot(), 1.0)
                await asyncio.wait((future,), timeout=admission._heartbeat_s)
        await future

    def release(self) -> None:
        """Give the slots (or the place in the line) back; a second call does nothing."""
        if self._released:
            return
        self._released = True
        self._admission._drop(self)

    def reroute(self, known_by: float | None = None) -> None:
        """Its upstream did not take the request (refused, down, restarting): give the slots
        back and wait again at the head of the line, for whichever upstream has room first;
        `wait` fails with NotReady if no upstream's capacity is known by `known_by`
        (time.monotonic())."""
        if self._released or self.upstream is None:
            return
        self.rerouted = True
        self._known_by = known_by
        self._admission._reroute(self)

    async def aclose(self) -> None:
        """`release`, and wait until Redis has it (or gave up trying)."""
        self.release()
        await self._admission.settle()

    async def __aenter__(self) -> SharedTicket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = f"granted on {self.upstream}" if self.granted else "waiting"
        return f"<SharedTicket {self.member or self.id} {state}>"


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
        self._url = url
        self._prefix = f"slotgate:{{{fleet}}}:"
        self.replica = replica or f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(3)}"
        self._channel = f"{self._prefix}ch:{self.replica}"
        self._policy = policy or QueuePolicy()
        self._epsilon = epsilon
        self._queue_timeout_s = queue_timeout_s
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._ttl_ms = round(ttl_s * 1000)
        #: How long Redis keeps counting this replica's grants once it gave the replica up.
        self._kept_ms = round((KEPT_TTLS * ttl_s if kept_s is None else kept_s) * 1000)
        self._failure_mode = failure_mode
        self._client: aioredis.Redis = aioredis.Redis.from_pool(
            aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections + 2,
                timeout=timeout_s,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                # Fail fast: a retry would only stretch the time before degrading.
                retry=Retry(NoBackoff(), 0),
            )
        )
        # The pool has two more: the grants' subscription and the recovery ping.
        self._calls = asyncio.Semaphore(max_connections)
        self.mode = Mode.DEGRADED
        self.fallbacks_total = 0
        #: Why Redis was last found unusable.
        self.last_error = ""
        self._fleet = Fleet()
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
        #: Degraded mode: this replica's own slots in use per upstream.
        self._local_active: dict[str, int] = {}
        #: Degraded mode: the slots per upstream Redis still counts for this replica (its
        #: grants when it fell back), until `_kept_until`.
        self._kept: dict[str, int] = {}
        #: When (time.monotonic()) the last heartbeat that Redis took was sent.
        self._renewed_at: float | None = None
        #: Redis refused or closed a connection since it last answered: it is down (for every
        #: replica), not out of reach from this one alone.
        self._refused = False
        self._hold_ewma_s = INITIAL_HOLD_S
        #: The last grant number this replica was given (the fleet's count, see `_grants`).
        self._last_grant = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pending: set[asyncio.Task[Any]] = set()
        self._shared = asyncio.Event()  # set while in shared mode
        self._joining: asyncio.Future[None] | None = None
        #: Changes at every degrade and rejoin: an answer from an older epoch is stale.
        self._epoch = 0
        self._stale_pool = False
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._closed = False

    # -- life ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the fleet (or start degraded, if Redis does not answer); keep the heartbeat."""
        with contextlib.suppress(Down):
            await self._join()
        self._keeper = asyncio.create_task(self._keep(), name="slotgate-shared-heartbeat")

    async def close(self) -> None:
        """Take no new work, refuse every waiter, hand back what Redis counts for this replica;
        within a few `timeout_s` whatever Redis does (what does not reach it, Redis takes back
        when this replica's lease runs out)."""
        self._closed = True
        for ticket in list(self._waiters.values()):
            self._fail(ticket, ShuttingDown(self._snapshot(), 1.0))
        # Waited on, not awaited: a Redis call may turn the cancellation into an error, and
        # the task goes on (it stops at its next turn, having seen `_closed`).
        await _stop((self._keeper, self._listener), self._timeout_s)
        await self.settle(self._timeout_s)
        for task in self._pending:
            task.cancel()  # a release still waiting for a connection: RETIRE covers it
        if self.mode is Mode.SHARED:
            with contextlib.suppress(Down, TimeoutError):
                # A connection (the releases left give theirs back at once), then the call.
                async with asyncio.timeout(2 * self._timeout_s):
                    await self._call("RETIRE", self.replica, self._epsilon)
        await self._unsubscribe()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._timeout_s):
                await self._client.aclose()

    async def settle(self, within_s: float | None = None) -> None:
        """Until the releases already made have reached Redis (or failed), or `within_s`."""
        deadline = None if within_s is None else time.monotonic() + within_s
        while self._pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            await asyncio.wait(list(self._pending), timeout=left)

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
            return Snapshot(
                sum(self._shares().values()) or None,
                sum(self._local_active.values()),
                len(self._waiters),
                self._local_limit(),
            )
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
                self._degrade(str(exc))
            return
        self._dispatch_local()

    async def rekey(self, old: str, new: str) -> None:
        """An upstream is known by another name now: what this replica holds there is held
        under `new`, here and in Redis, and `old` is unknown (`resize` `new` after this)."""
        self._capacities.pop(old, None)
        self._budgets.pop(old, None)
        for ticket in self._tickets.values():
            if ticket.upstream == old:
                ticket.upstream = new
        for counts in (self._local_active, self._kept):
            if old in counts:
                counts[new] = counts.get(new, 0) + counts.pop(old)
        if self.mode is Mode.SHARED:
            try:
                await self._call("REKEY", self.replica, old, new)
            except Down as exc:
                # The rejoin registers the grants under their new name.
                self._degrade(str(exc))

    async def retune(self, tenant: str, share: float, max_active: int | None) -> None:
        """A tenant's share and max_active reloaded: its waiters, here and in Redis, take
        them (a raised max_active lets them run on free slots at once)."""
        if share <= 0:
            raise ValueError(f"share must be positive, got {share}")
        tenant = tenant.replace("\t", " ").replace("\n", " ")
        for ticket in self._waiters.values():
            if ticket.tenant == tenant:
                ticket.share, ticket.max_active = share, max_active
        if self.mode is Mode.SHARED:
            try:
                await self._call("RETUNE", tenant, repr(share), _unset(max_active), self._epsilon)
            except Down as exc:
                self._degrade(str(exc))

    async def enter(
        self,
        weight: int = 1,
        cost: int = 0,
        ranking: Sequence[str] = (),
        band: int = 0,
        tag: float | None = None,
        *,
        tenant: str = "",
        share: float = 1.0,
        max_active: int | None = None,
        max_queued: int | None = None,
        tasks: int = 0,
    ) -> SharedTicket:
        """Take `weight` slots on one upstream now, or a place in the line, or raise why not.

        `ranking` is the request's upstreams by affinity, best first (empty: a free slot
        drawn evenly); `cost` its tokens of an upstream's KV-cache budget. The line serves a
        higher `band` first; inside a band, `tenant`s ("": none, FIFO) by their `share` of
        slot time, each FIFO; `tag` overrides the order inside the band (lower first).
        `max_active` (slots) and `max_queued` (places) are the tenant's own limits. `tasks`,
        when more than `weight`, is the tasks llama-server makes of a prompt array: it holds as
        many slots as it has tasks, up to those of the upstream that grants it (`weight` at
        least); the ticket's `weight` is then what it holds.
        """
        if self._closed:
            raise ShuttingDown(self._snapshot(), 1.0)
        if share <= 0:
            raise ValueError(f"share must be positive, got {share}")
        if tenant and max_active is not None and weight > max_active:
            # Its tenant may never hold that many slots at once: it could never run.
            raise TooLarge(self._snapshot(), weight, max_active)
        order = next(self._ids)
        ticket = SharedTicket(
            self, f"{self.replica}.{order}", order, weight, cost, ranking, band, tag,
            tenant, share, max_active, max_queued, tasks,
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
                return await self._enter_shared(ticket)
            except Down as exc:
                self._degrade(str(exc))
            except Stale:
                stale += 1
        return self._enter_local(ticket)

    async def _enter_shared(self, ticket: SharedTicket) -> SharedTicket:
        policy = self._policy
        args = (
            self.replica, ticket.id, ticket.weight, ticket.cost, "\n".join(ticket.ranking),
            self._epsilon, ticket.band, "" if ticket.tag is None else repr(ticket.tag),
            _unset(policy.max_queue), _unset(policy.queue_per_slot), _unset(policy.min_queue),
            ticket.tenant, repr(ticket.share), _unset(ticket.max_active),
            _unset(ticket.max_queued), ticket.tasks,
        )  # fmt: skip
        # The script runs as its own task: a caller cancelled while it runs must not strand
        # what it took in Redis, so whatever it took is handed back when it completes.
        epoch = self._epoch
        task = asyncio.ensure_future(self._call("ENTER", *args))
        # Known before the answer: its grant may be published, and read, before the reply.
        self._tickets[ticket.id] = ticket
        try:
            reply = await asyncio.shield(task)
            return await self._answer(ticket, reply, epoch)
        except BaseException as exc:
            self._tickets.pop(ticket.id, None)
            if isinstance(exc, asyncio.CancelledError):
                if task.done():
                    self._orphan(task, ticket)
                else:
                    task.add_done_callback(lambda t: self._orphan(t, ticket))
            raise

    async def _answer(self, ticket: SharedTicket, reply: list[bytes], epoch: int) -> SharedTicket:
        kind = reply[0].decode()
        if kind in ("grant", "queued"):
            member = reply[1].decode()
            early = self._early.pop(member, None)
            if epoch != self._epoch or self._joining is not None:
                # A rejoin's list was made while this ran: Redis forgets (or forgot) it.
                self._spawn(self._release_shared(member, None))
                raise Stale
            ticket.member = member
            if kind == "grant":
                self._granted(
                    ticket, reply[2].decode(), reply[3].decode(), int(reply[4]), int(reply[5])
                )
                return ticket
            self._waiters[ticket.id] = ticket
            ticket.position = int(reply[2])
            ticket.since = int(reply[4])
            ticket._future = asyncio.get_running_loop().create_future()
            if early is not None:
                self._granted(ticket, *early)
            return ticket
        if kind == "fenced":
            await self._rejoin()
            raise Stale
        if kind == "full":
            self._fleet = Fleet.parse(reply[2:])
            queued = self._fleet.queued
            raise QueueFull(self._snapshot(), self._retry_after_s(queued + ticket.weight))
        if kind == "tenant_full":
            self._fleet = Fleet.parse(reply[3:])
            queued, active = int(reply[1]), int(reply[2])
            share = Share(ticket.tenant, ticket.share, active, queued, 0.0)
            snapshot = dataclasses.replace(self._snapshot(), tenant=share)
            # A place of its own frees when its first waiter is granted.
            over = queued - (ticket.max_queued or 0) + 1
            raise TenantQueueFull(snapshot, self._retry_after_s(over))
        if kind == "large":
            self._fleet = Fleet.parse(reply[2:])
            raise TooLarge(self._snapshot(), ticket.least, int(reply[1]))
        self._fleet = Fleet.parse(reply[1:])
        raise NotReady(self._snapshot(), 1.0)

    def _orphan(self, task: asyncio.Future[Any], ticket: SharedTicket) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        reply = task.result()
        if reply[0] in (b"grant", b"queued"):
            member = reply[1].decode()
            self._early.pop(member, None)
            ticket._released = True
            self._spawn(self._release_shared(member, None))

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
        upstream = ticket.upstream
        if upstream is not None:
            self._local_active[upstream] = max(
                self._local_active.get(upstream, 0) - ticket.weight, 0
            )
        if self.mode is Mode.DEGRADED and self._joining is None:
            self._dispatch_local()

    def _reroute(self, ticket: SharedTicket) -> None:
        upstream, ticket.upstream = ticket.upstream, None
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
        if upstream is not None:
            self._local_active[upstream] = max(
                self._local_active.get(upstream, 0) - ticket.weight, 0
            )
        ticket.weight = ticket.least  # weighed again where it is granted next
        if self.mode is Mode.DEGRADED and self._joining is None:
            self._dispatch_local()

    async def _reroute_shared(self, ticket: SharedTicket, member: str) -> None:
        try:
            await self._call("REROUTE", self.replica, member, self._epsilon)
        except Down as exc:
            # It waits in this replica's line now; the rejoin lists it as a waiter.
            self._degrade(str(exc))
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
            self._degrade(str(exc))

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
        async with self._calls:
            if self._epoch != epoch and self.mode is Mode.DEGRADED:
                raise Down(f"{name}: fell back while waiting for a connection")
            return await self._script(name, args)

    async def _script(self, name: str, args: tuple[str | int | float, ...]) -> Any:
        function = shared_lua.FUNCTIONS[name]
        client = self._client
        try:
            async with asyncio.timeout(self._timeout_s):
                try:
                    return await client.fcall(function, 1, self._prefix, *args)
                except ResponseError as exc:
                    # Not loaded yet, or Redis restarted empty: load the library, call again.
                    if "function not found" not in str(exc).lower():
                        raise
                    await client.function_load(shared_lua.LIBRARY, replace=True)
                    return await client.fcall(function, 1, self._prefix, *args)
        except (RedisError, OSError, TimeoutError) as exc:
            # A script error too (ResponseError): Redis is not usable as it is, so gate
            # locally rather than fail requests; `last_error` says why.
            self._heard(exc)
            raise Down(f"{name}: {exc!r}") from exc

    async def _subscribe(self) -> None:
        await self._unsubscribe()
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            async with asyncio.timeout(self._timeout_s):
                await pubsub.subscribe(self._channel)
        except (RedisError, OSError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            raise Down(f"SUBSCRIBE: {exc!r}") from exc
        self._pubsub = pubsub
        self._listener = asyncio.create_task(self._listen(pubsub), name="slotgate-shared-grants")

    async def _unsubscribe(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and listener is not asyncio.current_task():
            await _stop((listener,), self._timeout_s)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._timeout_s):
                    await pubsub.aclose()

    async def _listen(self, pubsub: Any) -> None:
        try:
            async for message in pubsub.listen():
                if message["type"] == "message":
                    self._on_grant(message["data"].decode())
        except (RedisError, OSError) as exc:
            if not self._closed:
                self._heard(exc)
                self._degrade(str(exc))

    def _on_grant(self, data: str) -> None:
        member, upstream, reason, grant_no, weight = data.split("\t")
        grant = (upstream, reason, int(grant_no), int(weight))
        if self._joining is not None:
            # The rejoin's own dispatch may grant a place whose name its reply has not told yet.
            self._early[member] = grant
            return
        if self.mode is Mode.DEGRADED:
            return  # Redis forgets this place when the replica rejoins; the waiter waits here
        ticket = self._tickets.get(member.split("|", 1)[1])
        if ticket is None or ticket._released:
            return  # it left: its leave (RELEASE) finds it granted and returns the slots
        if ticket.member is None:
            self._early[member] = grant
            return
        if ticket.member != member or ticket.granted:
            return  # a grant to a place the ticket had before a rejoin: Redis forgot it
        if reason == "large":
            self._fail(ticket, TooLarge(self._snapshot(), ticket.least))
            return
        self._granted(ticket, *grant)

    async def _keep(self) -> None:
        """The heartbeat in shared mode; while degraded, ping until Redis answers and rejoin."""
        while not self._closed:
            if self.mode is Mode.SHARED:
                await asyncio.sleep(self._heartbeat_s)
                if self._closed:
                    return
                sent = time.monotonic()
                try:
                    reply = await self._call(
                        "HEARTBEAT", self.replica, self._ttl_ms, self._epsilon, self._kept_ms
                    )
                except Down as exc:
                    self._degrade(str(exc))
                    continue
                if reply[0] == b"fenced":
                    await self._rejoin()
                else:
                    self._renewed_at = max(self._renewed_at or sent, sent)
                    self._fleet = Fleet.parse(reply[1:])
                    self._hear_budgets(reply[7:])
            else:
                if self._stale_pool:
                    # Connections to a Redis that restarted fail one by one when next used:
                    # start over, so that the rejoin is not followed by a second fallback.
                    self._stale_pool = False
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(self._timeout_s):
                            await self._client.connection_pool.disconnect()
                await asyncio.sleep(min(self._heartbeat_s, 0.2))
                if self._closed:
                    return
                # A ping first: local dispatch waits while a rejoin runs, so only try one
                # once Redis answers.
                if await self._answers():
                    await self._rejoin()
                else:
                    # The slots Redis kept for this replica may have become its share.
                    self._dispatch_local()

    def _hear_budgets(self, raw: Sequence[bytes]) -> None:
        """Budgets Redis holds that this replica has not learned: tell `on_budget`."""
        if self.on_budget is None:
            return
        for upstream, budget in zip(raw[::2], raw[1::2], strict=True):
            name = upstream.decode()
            if name in self._capacities and name not in self._budgets:
                self.on_budget(name, int(budget))

    async def _answers(self) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._client.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self._heard(exc)
            return False
        return True

    def _heard(self, exc: BaseException) -> None:
        """Note whether Redis's host refused a connection, or closed one in shared mode (a
        connection closed later may be this replica's own doing: `_keep` drops its pool)."""
        if not self._refused:
            self._refused = _refused(exc, closed=self.mode is Mode.SHARED)

    async def _join(self) -> None:
        await self._subscribe()
        await self._rejoin()

    async def _rejoin(self) -> None:
        """Replace what Redis holds for this replica with what it holds; shared mode after."""
        if self._joining is not None:
            await asyncio.shield(self._joining)
            return
        self._joining = asyncio.get_running_loop().create_future()
        self._epoch += 1
        try:
            if self._listener is None or self._listener.done():
                try:
                    await self._subscribe()
                except Down as exc:
                    self._degrade(str(exc))
                    self._dispatch_local()
                    return
            grants = [t for t in self._tickets.values() if t.granted]
            waiters = sorted(self._waiters.values(), key=lambda t: t.order)
            args: list[str | int | float] = [
                self.replica, self._ttl_ms, self._epsilon, self._kept_ms,
                len(self._capacities), len(grants), len(waiters),
            ]  # fmt: skip
            for upstream, capacity in self._capacities.items():
                args += (upstream, capacity, self._budgets.get(upstream, ""))
            for t in grants:
                args += (
                    t.member or f"{0:016x}|{t.id}", t.upstream or "", t.weight, t.least, t.tasks,
                    t.cost, t.band, t.tenant, repr(t.share), _unset(t.max_active),
                    "\n".join(t.ranking),
                )  # fmt: skip
            for t in waiters:
                tag = "" if t.tag is None else repr(t.tag)
                args += (
                    t.id, t.least, t.tasks, t.cost, "\n".join(t.ranking), t.band, tag, t.tenant,
                    repr(t.share), _unset(t.max_active),
                )  # fmt: skip
            self._early.clear()
            sent = time.monotonic()
            try:
                reply = await self._call("REJOIN", *args)
            except Down as exc:
                self._degrade(str(exc))
                # Whatever was released while it ran is free on this replica's share now.
                self._dispatch_local()
                return
            self._renewed_at = sent
            self._refused = False
            fleet = self._fleet = Fleet.parse(reply[:6])
            # Redis may have restarted empty: its count starts again.
            self._last_grant = fleet.granted
            for place, (t, member) in enumerate(zip(waiters, reply[6:], strict=True)):
                # A waiter that left (or was granted locally) while the rejoin ran: Redis holds
                # a place for it that nobody will claim, so give it back.
                if t._released or t.granted:
                    self._spawn(self._release_shared(member.decode(), None))
                    continue
                t.member = member.decode()
                # At the back of the line, in their order.
                t.position = max(fleet.queued - len(waiters) + place + 1, 1)
                t.since = fleet.granted
                early = self._early.pop(t.member, None)
                if early is not None:
                    self._granted(t, *early)
            for t in grants:
                if t.member is None:
                    t.member = f"{0:016x}|{t.id}"
                if t._released:
                    self._spawn(self._release_shared(t.member, None))
                elif not t.granted:  # rerouted while the rejoin ran
                    self._spawn(self._reroute_shared(t, t.member))
            # What is left names places of before the rejoin, or of enters still in flight.
            self._early = {m: e for m, e in self._early.items() if self._in_flight(m)}
            self._local_active.clear()
            self.mode = Mode.SHARED
            self._shared.set()
        finally:
            joining, self._joining = self._joining, None
            joining.set_result(None)

    def _in_flight(self, member: str) -> bool:
        ticket = self._tickets.get(member.split("|", 1)[1])
        return ticket is not None and ticket.member is None

    def _degrade(self, why: str = "") -> None:
        """Redis is away: gate on this replica's share until it answers again."""
        if why:
            self.last_error = why
        if self.mode is Mode.DEGRADED or self._closed:
            return
        self.mode = Mode.DEGRADED
        self._epoch += 1
        self._stale_pool = True
        self._shared.clear()
        self.fallbacks_total += 1
        active: dict[str, int] = {}
        for t in self._tickets.values():
            if t.granted and t.upstream is not None:
                active[t.upstream] = active.get(t.upstream, 0) + t.weight
        self._local_active = active
        self._kept = dict(active)
        if self._failure_mode == "reject":
            for t in list(self._waiters.values()):
                self._fail(t, NotReady(self._snapshot(), 1.0))
            return
        self._dispatch_local()

    # -- degraded mode: this replica's share -------------------------------------------------

    def _shares(self) -> dict[str, int]:
        if self._keeping():
            # Cut off from a Redis the others may still reach: only the slots Redis counts
            # for this replica are sure to be nobody else's.
            kept = self._kept
            return {u: min(kept[u], c) for u, c in self._capacities.items() if kept.get(u)}
        n = max(self._fleet.replicas, 1)
        return {u: max(c // n, 1) for u, c in self._capacities.items()}

    def _keeping(self) -> bool:
        """Does Redis still count this replica's grants of the fallback, while it may be
        serving the other replicas? Until its lease and the keeping after it have run out
        (by this replica's clock, from the last heartbeat Redis took, less a margin), unless
        Redis refused a connection: then it is down for every replica."""
        renewed = self._renewed_at
        if renewed is None or self._refused:
            return False
        kept_s = (self._ttl_ms + self._kept_ms) / 1000 - self._timeout_s
        return time.monotonic() < renewed + kept_s

    def _local_limit(self) -> int | None:
        capacity = sum(self._capacities.values())
        if not capacity:
            return None
        limit = self._policy.limit(capacity)
        if limit is None:
            return None
        return max(limit // max(self._fleet.replicas, 1), 1)

    def _enter_local(self, ticket: SharedTicket) -> SharedTicket:
        if self._failure_mode == "reject":
            raise NotReady(self._snapshot(), 1.0)
        shares = self._shares()
        if not shares:
            raise NotReady(self._snapshot(), 1.0)
        if ticket.least > max(self._capacities.values()):
            raise TooLarge(self._snapshot(), ticket.least, max(self._capacities.values()))
        if ticket.least > max(shares.values()):
            # It fits an upstream, not this replica's share of one: it may run once Redis is
            # back, so it is refused as for now (503), not as a request to change (400).
            raise NotReady(self._snapshot(), 1.0)
        if not self._waiters:
            upstream, reason = self._choose_local(ticket, shares)
            if upstream is not None:
                self._tickets[ticket.id] = ticket
                ticket.weight = ticket.weighs(shares[upstream])
                self._local_active[upstream] = self._local_active.get(upstream, 0) + ticket.weight
                ticket.upstream, ticket.reason = upstream, reason
                ticket.admitted_at = time.monotonic()
                return ticket
        limit = self._local_limit()
        if limit is not None and len(self._waiters) >= limit:
            raise QueueFull(self._snapshot(), self._retry_after_s(len(self._waiters) + 1))
        ticket._future = asyncio.get_running_loop().create_future()
        self._tickets[ticket.id] = ticket
        self._waiters[ticket.id] = ticket
        ticket.position = len(self._waiters)
        ticket.since = self._grants()
        return ticket

    def _choose_local(self, ticket: SharedTicket, shares: dict[str, int]) -> tuple[str | None, str]:
        """The same rule as the script's `choose`, over this replica's shares (a prompt array
        weighed on each share: what it may hold of that upstream while this replica gates
        alone)."""
        active = self._local_active
        w = ticket.weighs(max(shares.values()))
        load = (sum(active.get(u, 0) for u in shares) + w) * (1 + self._epsilon)
        load /= sum(shares.values())
        ranked = [u for u in ticket.ranking if u in shares]
        for rank, u in enumerate(ranked):
            a = active.get(u, 0) + ticket.weighs(shares[u])
            if a <= shares[u] and active.get(u, 0) + w <= math.ceil(load * shares[u]):
                return u, "affinity" if rank == 0 else "load"
        best: tuple[float, int, str] | None = None
        for u, c in shares.items():
            a = active.get(u, 0) + ticket.weighs(c)
            if a <= c and (best is None or (a / c, a - c, u) < best):
                best = (a / c, a - c, u)
        return (best[2], "load") if best is not None else (None, "busy")

    def _dispatch_local(self) -> None:
        if self.mode is not Mode.DEGRADED or self._failure_mode == "reject":
            return
        shares = self._shares()
        if not shares:
            # Cut off holding nothing: its waiters keep their places (QUEUE_TIMEOUT bounds
            # them) for Redis to answer again, or for the keeping to run out.
            return
        largest = max(shares.values())
        for ticket in sorted(self._waiters.values(), key=lambda t: t.order):
            if ticket.least > largest:
                # Entered while shared: it can never run on a share, and would stop the line.
                self._fail(ticket, NotReady(self._snapshot(), 1.0))
                continue
            upstream, reason = self._choose_local(ticket, shares)
            if upstream is None:
                return  # the head only: nobody overtakes it
            weight = ticket.weighs(shares[upstream])
            self._local_active[upstream] = self._local_active.get(upstream, 0) + weight
            ticket.member = None  # Redis will know it only from the rejoin's list of grants
            self._granted(ticket, upstream, reason, 0, weight)


async def _stop(tasks: Sequence[asyncio.Task[Any] | None], within_s: float) -> None:
    """Cancel `tasks` and wait until they end, `within_s` at most. Not `await task`: a task
    that turns its cancellation into an error (as a Redis client may) would go on, and an
    `await` on it inside `suppress(CancelledError)` would swallow the caller's own."""
    live = [task for task in tasks if task is not None and not task.done()]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live, timeout=within_s)
    for task in live:
        if task.done() and not task.cancelled():
            task.exception()  # seen: an error of a task being stopped says nothing more


def _unset(value: int | None) -> int:
    return -1 if value is None else value


def _refused(exc: BaseException, closed: bool) -> bool:
    """Did Redis's host refuse a connection (or close one, if `closed` counts): stopped or
    restarting, as opposed to not answering (slow, or out of reach from here alone)?"""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        if closed and isinstance(seen, ConnectionResetError):
            return True
        if closed and isinstance(seen, RedisConnectionError) and "closed by server" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


__all__ = [
    "Down",
    "Fleet",
    "Mode",
    "SharedAdmission",
    "SharedSnapshot",
    "SharedTicket",
]
