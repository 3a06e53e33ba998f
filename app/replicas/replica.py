"""Admission when several slotgate replicas share one line through Redis or Valkey (REDIS_URL).

The shared line (replicas/shared.py) decides who runs, when and on which upstream, for every replica
at once. This replica's own core (app/gate/admission.py) then holds what it was granted (`hold`),
room or not: it no longer decides, it counts this replica's part, so that the request path,
the per-upstream figures, the tenants' counts and the hold times behind the estimates work as
they do for one process. The core's line stays empty.

`ReplicaTicket` is the request's claim: a place in the shared line, then a ticket of the core
on the granted upstream's pool, released together on every way out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from slotgate.errors import (
    NotReady,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    TenantTooLarge,
    TooLarge,
)
from slotgate.gate.admission import Admission
from slotgate.gate.entry import Entry
from slotgate.gate.pool import Pool
from slotgate.gate.routing import score
from slotgate.gate.tenants import Tenant
from slotgate.gate.ticket import Ticket
from slotgate.replicas.shared import Mode, SharedAdmission, SharedTicket
from slotgate.settings import Settings

log = logging.getLogger("slotgate.replica")

_DEFAULT_PORTS = {"http": 80, "https": 443}


def fleet_name(url: str) -> str:
    """An upstream's name in Redis: its URL as every replica spells it (scheme and host in
    lower case, no default port, no trailing slash), or two replicas configured with two
    spellings of one llama-server would each count its slots."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    return urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))


@dataclass(slots=True, eq=False, repr=False)
class ReplicaTicket:
    """One request's claim on the fleet's shared slots (see `Claim` in app/gate/ticket.py).

    Entered while an operator paused this replica (shared mode), it is held back: no shared
    ticket yet (`_shared` None) until its `wait` sees the resume and joins the shared line, so
    that the request waits where its client's leaving and an operator's cancel reach it.
    """

    _gate: ReplicaAdmission
    _shared: SharedTicket | None
    weight: int
    cost: int
    affinity: int | None
    tenant: Tenant
    conversation: int | None = None
    #: Held back by a pause: what it joins the shared line with once resumed.
    _join: Entry | None = None
    entered_at: float = field(init=False)
    #: The core's ticket on the granted upstream's pool, once granted.
    _local: Ticket | None = field(default=None, init=False)
    rerouted: bool = field(default=False, init=False)
    _released: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        shared = self._shared
        self.entered_at = time.monotonic() if shared is None else shared.entered_at

    @property
    def admitted(self) -> bool:
        return self._local is not None

    @property
    def admitted_at(self) -> float | None:
        return self._local.admitted_at if self._local is not None else None

    @property
    def released(self) -> bool:
        return self._released

    @property
    def wait_s(self) -> float:
        return (self.admitted_at or time.monotonic()) - self.entered_at

    @property
    def pool(self) -> Pool | None:
        return self._local.pool if self._local is not None else None

    @property
    def position(self) -> int:
        """1-based place in the fleet's line (0 once admitted), as this replica last heard."""
        if self.admitted:
            return 0
        if self._shared is None:  # behind the whole shared line
            return self._gate.shared.snapshot().queued + 1
        return max(self._shared.place, 1)

    async def wait(self) -> None:
        """Wait for the shared line's grant, then hold it on this replica's pool; on any exit
        without it, leave the line at once."""
        if self.admitted:
            return
        gate = self._gate
        shared = self._shared
        try:
            if shared is None:
                shared = self._shared = await gate._after_pause(self)
            if not shared.granted:
                await gate._until_granted(shared)
        except TooLarge as exc:
            self.release()
            limit = self.tenant.max_active
            # Its slots as the shared line counts them against the limit (a prompt array: on
            # the largest upstream).
            weight = self.weight if shared is None else shared.weighs(gate.admission.largest or 0)
            if limit is not None and weight > limit:
                # Its tenant's max_active was lowered under its slots while it waited.
                raise TenantTooLarge(exc.snapshot, weight, self.tenant) from None
            raise
        except BaseException:
            self.release()
            raise
        self._hold()

    def _hold(self) -> None:
        shared = self._shared
        gate = self._gate
        assert shared is not None  # noqa: S101 - granted: it joined the shared line
        pool = gate.pool_of(shared.upstream)
        if pool is None:
            # Granted on an upstream this replica does not know (configured differently, or gone
            # from its DNS since): not one it can send to.
            self.release()
            raise NotReady(gate.admission.snapshot(), 1.0)
        reason = "retry" if self.rerouted else shared.reason or "load"
        # What the shared line weighed it at there (a prompt array: that upstream's share).
        self.weight = shared.weight
        self._local = gate.admission.hold(
            pool, self.weight, self.cost, self.affinity,
            tenant=self.tenant, reason=reason, conversation=self.conversation,
        )  # fmt: skip

    def reroute(self, known_by: float) -> None:
        """Its upstream did not take the request: give the slots back to the fleet and wait
        again at the head of the shared line, until `known_by` at most."""
        local = self._local
        if self._released or local is None:
            return
        self._local = None
        local.release()
        self.rerouted = True
        # Sent back by its upstream: it waits at the head of the shared line, and is refused
        # (NotReady) if no upstream is known by `known_by` (STARTUP_WAIT_S after the refusal).
        assert self._shared is not None  # noqa: S101 - it was admitted
        self._shared.reroute(known_by)

    def recost(self, cost: int) -> None:
        self.cost = cost
        if self._local is not None:
            self._local.recost(cost)

    def release(self) -> bool:
        """Give the slots (or the place in the shared line) back; a second call does nothing.

        True when slots went back to the fleet, where a waiter on any replica may take them:
        the caller should then yield once (as after a local hand-off), so that the release
        is on its way to Redis before the caller carries on (it measured 0.5 ms later else).
        """
        if self._released:
            return False
        self._released = True
        # The core's ticket is kept, released, as the core keeps its own: the request's
        # account (app/proxy/accounting.py), made after this, reads its hold from it.
        local = self._local
        if local is not None:
            local.release()
        if self._shared is not None:
            self._shared.release()
        else:
            self._gate._held.discard(self)
        return local is not None

    async def __aenter__(self) -> ReplicaTicket:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


class ReplicaAdmission:
    """This replica's admission through the shared line, over its own core's pools."""

    def __init__(self, settings: Settings, admission: Admission, url: str) -> None:
        self.admission = admission
        self.shared = SharedAdmission(
            url,
            settings.redis_fleet,
            policy=settings.queue_policy,
            epsilon=settings.routing_epsilon,
            queue_timeout_s=settings.queue_timeout_s or None,
            timeout_s=settings.redis_timeout_s,
            heartbeat_s=settings.redis_ttl_s / 3,
            ttl_s=settings.redis_ttl_s,
            failure_mode=settings.redis_failure_mode,
        )
        self.failure_mode = settings.redis_failure_mode
        self._timeout_s = settings.redis_timeout_s
        self._queue_timeout_s = settings.queue_timeout_s or None
        # Set unless an operator paused this replica; requests held back meanwhile (shared
        # mode: they wait here, before the shared line).
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._held: set[ReplicaTicket] = set()
        self._affinity = settings.routing == "affinity"
        #: The key, capacity and budget each pool is known by in Redis, as last told.
        self._told: dict[Pool, tuple[str, int | None, int | None]] = {}
        # Changes reach Redis one at a time, in the order they happened.
        self._order = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing: asyncio.Future[None] | None = None
        admission.on_change = self._changed
        #: Told of a pool whose KV budget another replica learned (its upstream learns it).
        self.learn: Callable[[Pool], None] | None = None
        self.shared.on_budget = self._heard_budget

    # -- life ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._closing = asyncio.get_running_loop().create_future()
        await self.shared.start()
        log.info(
            "sharing the line through Redis as replica %s (%s)",
            self.shared.replica,
            self.shared.mode.value,
        )

    def drain(self) -> None:
        """Shutdown has begun: no new requests; the waiters are turned away (ShuttingDown)."""
        self.admission.close()
        self._resumed.set()  # those held back by a pause: refused as they go on
        if self._closing is not None and not self._closing.done():
            self._closing.set_result(None)

    async def close(self) -> None:
        """Once the running requests have ended: hand back whatever Redis still counts here,
        in a few REDIS_TIMEOUTs at most."""
        self.drain()
        tasks = list(self._tasks)
        if tasks:
            # Changes still on their way to Redis, each a call or two: waited on for a while,
            # not awaited, then given up (RETIRE hands back whatever they were about).
            await asyncio.wait(tasks, timeout=2 * self._timeout_s)
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # seen: RETIRE follows, whatever the change did
        await self.shared.close()

    def pause(self) -> None:
        """Pause this replica, not the fleet: in shared mode its new requests wait here, before
        the shared line (bounded by the line's limit and QUEUE_TIMEOUT_S), and its waiters
        already in the shared line may still be granted; degraded, its own core grants
        nobody, as in one process. The other replicas admit as ever."""
        self.admission.pause()
        self.shared.pause(True)
        self._resumed.clear()

    def resume(self) -> None:
        self.admission.resume()
        self.shared.pause(False)
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return self.admission.paused

    @property
    def held_back(self) -> int:
        """Requests a pause holds before the shared line (shared mode)."""
        return len(self._held)

    def _hold_back(self, ticket: ReplicaTicket) -> ReplicaTicket:
        """Hold `ticket` back until `resume`, as one of the line: refused past its limit."""
        shared = self.shared
        limit = shared._limit()
        if limit is not None and len(self._held) + shared.snapshot().queued >= limit:
            raise QueueFull(shared._snapshot(), 1.0)
        self._held.add(ticket)
        return ticket

    async def _after_pause(self, ticket: ReplicaTicket) -> SharedTicket:
        """`ticket`'s wait while held back: for `resume` (refused past QUEUE_TIMEOUT_S), then
        into the shared line. Its leaving meanwhile (a cancel) is its `release`."""
        join = ticket._join
        assert join is not None  # noqa: S101 - only a held-back ticket comes here
        try:
            async with asyncio.timeout(self._queue_timeout_s):
                await self._resumed.wait()
        except TimeoutError:
            raise QueueTimeout(self.shared._snapshot(), 1.0) from None
        finally:
            self._held.discard(ticket)
        if ticket._released:  # released while the resume was on its way
            raise asyncio.CancelledError
        return await self._join_line(join)

    # -- reading -----------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """shared; degraded (gating alone on a share); rejecting (degraded, REDIS_FAILURE_MODE
        reject)."""
        if self.shared.mode is Mode.SHARED:
            return "shared"
        return "degraded" if self.failure_mode == "local" else "rejecting"

    def unready(self) -> str | None:
        if self.mode != "rejecting":
            # Degraded (Redis away, gating on this replica's share) is still ready.
            return None
        return f"Redis unreachable ({self.shared.last_error}); REDIS_FAILURE_MODE=reject"

    def pool_of(self, key: str | None) -> Pool | None:
        for pool in self.admission.pools:
            if fleet_name(pool.key) == key and not pool.retired:
                return pool
        return None

    def view(self) -> dict[str, Any]:
        """The fleet as Redis last told it, and this replica's part (`/admission`)."""
        snap = self.shared.snapshot()
        fleet = snap.fleet
        return {
            "mode": self.mode,
            "replica": self.shared.replica,
            "fleet": {
                "capacity": fleet.capacity,
                "active": fleet.active,
                "queued": fleet.queued,
                "replicas": fleet.replicas,
                "hold_estimate_s": fleet.hold_s,
            },
            "this_replica": {"active": snap.active, "queued": snap.queued},
            "fallbacks": snap.fallbacks,
            "last_error": self.shared.last_error or None,
        }

    # -- changing ----------------------------------------------------------------------------

    def enter_now(self, entry: Entry) -> None:
        """Never at once: the shared line's answer comes from Redis (`enter`)."""
        return

    async def enter(self, entry: Entry) -> ReplicaTicket:
        """A place in the fleet's line (or its slots at once), or why neither is possible.
        `weight` is the fewest slots it runs in; `tasks` a prompt array's (as the core's
        `enter`): it holds as many slots as it has tasks, up to those of the upstream the
        shared line grants it. `weigh` (the request was read while no capacity was known
        here) refuses it: the shared line has no startup wait."""
        weight, cost, weigh, affinity, tenant, _, conversation, tasks = entry
        if weigh is not None:
            raise NotReady(self.admission.snapshot(), 1.0)
        limit = tenant.max_active
        # Its slots on the largest upstream: it could never run within its tenant's limit.
        heaviest = weight if not tasks else max(weight, min(tasks, self.admission.largest or 0))
        if limit is not None and heaviest > limit:
            # Refused before Redis is asked.
            raise TenantTooLarge(self.admission.snapshot(), heaviest, tenant)
        closing = self._closing
        if closing is None or closing.done():
            raise ShuttingDown(self.admission.snapshot(), 1.0)
        if not self._resumed.is_set() and self.shared.mode is Mode.SHARED:
            # Not awaited here: the request waits for the resume in its ticket's `wait`.
            return self._hold_back(
                ReplicaTicket(self, None, weight, cost, affinity, tenant, conversation, entry)
            )
        shared = await self._join_line(entry)
        ticket = ReplicaTicket(self, shared, weight, cost, affinity, tenant, conversation)
        if shared.granted:
            try:
                ticket._hold()
            except BaseException:
                ticket.release()
                raise
        return ticket

    async def _join_line(self, entry: Entry) -> SharedTicket:
        """A place in the fleet's line through Redis (or its slots at once)."""
        closing = self._closing
        if closing is None or closing.done():
            raise ShuttingDown(self.admission.snapshot(), 1.0)
        affinity, conversation = entry.affinity, entry.conversation
        if not self._affinity and affinity is not None:
            # The core routes by the key only under ROUTING=affinity, as the shared line does.
            entry = entry._replace(affinity=None)
        return await self.shared.enter(entry, self._ranking(affinity, conversation))

    def _ranking(self, affinity: int | None, conversation: int | None) -> list[str]:
        """The upstreams in the key's order (its conversation's last one first), as
        app/gate/routing.py ranks them; empty without a key: the script then takes the least
        loaded. (The last one is this replica's memory: another replica's is not shared.)"""
        if affinity is None or not self._affinity:
            return []
        pools = [pool for pool in self.admission.pools if pool.capacity and not pool.retired]
        if len(pools) < 2:
            return []
        ranked = sorted(pools, key=lambda pool: score(affinity, pool.salt), reverse=True)
        last = self.admission.last_pool(conversation if conversation is not None else affinity)
        if last is not None and last in ranked:
            ranked.remove(last)
            ranked.insert(0, last)
        return [fleet_name(pool.key) for pool in ranked]

    async def _until_granted(self, shared: SharedTicket) -> None:
        """The shared ticket's wait, cut short by shutdown."""
        closing = self._closing
        assert closing is not None  # noqa: S101 - started before any request
        waiting = asyncio.ensure_future(shared.wait())
        try:
            await asyncio.wait((waiting, closing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done():
                waiting.cancel()
                # asyncio.wait, not `await waiting` under suppress(CancelledError): that would
                # also swallow a cancellation of this request's own task arriving meanwhile.
                await asyncio.wait((waiting,))
        if not waiting.cancelled() and waiting.exception() is None:
            return
        if waiting.cancelled():
            raise ShuttingDown(self.admission.snapshot(), 1.0)
        error = waiting.exception()
        assert error is not None  # noqa: S101 - not cancelled and not a result
        raise error

    def retune(self, tenants: Iterable[Tenant]) -> None:
        """Reloaded tenants (API_KEYS_FILE on SIGHUP): their waiters in the shared line take
        their weights and max_active from now on, as in one process."""
        tenants = list(tenants)
        self.admission.retune(tenants)
        for tenant in tenants:
            task = asyncio.get_running_loop().create_task(
                self.shared.retune(tenant.name, tenant.weight, tenant.max_active)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _heard_budget(self, name: str, budget: int) -> None:
        pool = self.pool_of(name)
        if pool is not None and pool.budget is None and self.learn is not None:
            self.learn(pool)

    def _changed(self, pool: Pool) -> None:
        """A pool's capacity, budget or name changed: tell Redis, in order."""
        capacity = None if pool.retired else pool.capacity
        told = (fleet_name(pool.key), capacity, pool.budget)
        task = asyncio.get_running_loop().create_task(self._tell(pool, told))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell(self, pool: Pool, told: tuple[str, int | None, int | None]) -> None:
        async with self._order:
            before = self._told.get(pool)
            if before == told:
                return  # a props refresh that changed nothing
            key, capacity, budget = told
            if capacity is None and (before is None or before[:2] == (key, None)):
                # Never known here (a replica starting reads the budget before the slots):
                # nothing of this replica's to take back, and the others may know the upstream.
                self._forget_or_keep(pool, told)
                return
            if before is not None and before[0] != key:
                # Renamed: its running requests go on counting against its slots.
                await self.shared.rekey(before[0], key)
            self._told[pool] = told
            # No budget here, and none told from here before: one another replica learned for
            # it stays in Redis (and is heard at the next heartbeat).
            learned = before is not None and before[2] is not None
            await self.shared.resize(key, capacity, budget=budget, learned=learned)
            self._forget_or_keep(pool, told)

    def _forget_or_keep(self, pool: Pool, told: tuple[str, int | None, int | None]) -> None:
        # A retired pool is not told again (its address left DNS): not remembered either, or
        # a fleet whose addresses come and go would be remembered whole.
        if pool.retired:
            self._told.pop(pool, None)
        else:
            self._told[pool] = told
