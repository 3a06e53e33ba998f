"""The fair line: which waiter gets the next free slot when tenants share the slots.

Standard library only; it knows nothing of HTTP, slots or time, only of waiters and of the
slot-seconds they held. It can stand where the admission core keeps its FIFO line:

- A free slot goes to the highest band that has a waiter who may run.
- Inside a band, to the tenant furthest behind its weighted share of slot time: start-time
  fair queuing, one virtual time per (band, tenant) flow. A grant advances the flow's virtual
  time at once by a provisional charge (the tenant's average hold x slots / weight), so that a
  burst of grants is spread over the tenants rather than all given to one; the release
  replaces it with the slot-seconds actually held / weight, so a long generation costs its
  tenant what it cost the others. A flow that comes back after being idle starts at its
  band's virtual time (where the latest grant started, counting ended holds only), never
  behind it: it banks no credit.
- Inside a flow, first come first served; a ticket put back at the front (`push_front`, a
  failover) goes before every other waiter of its band.
- A tenant at its `max_active` is passed over (its waiters keep their places) and the others
  are served: no slot stays idle while anyone who may run waits.

Costs: O(log flows in the band) per push, pop and release, through one heap per band of the
flows that have waiters, keyed by (virtual time, seq of their head). A heap entry is not
searched for when its flow changes: a new one is pushed and the old one, no longer the flow's
`entry`, is dropped when it reaches the top. A waiter that gives up is uncounted at once
(`leave`) and dropped from its flow when it reaches the head (or at once, from the tail).

The core calls, on its own loop and without an await between them: `push` (a new waiter),
`head` and `pop_head` (the next waiter to grant), `granted` (for every grant, also to a
request admitted without waiting), `released` (every granted ticket, once), `leave` (a waiter
whose future is done other than by a grant).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from slotgate.gate.clock import INITIAL_HOLD_S, ewma
from slotgate.gate.waiter import Waiter, done, trimmed

if TYPE_CHECKING:
    from slotgate.gate.line import Line
    from slotgate.gate.tenants import Tenant

#: Ahead of every virtual time: a flow whose head was put back at the front.
_FRONT = -math.inf


W = TypeVar("W", bound=Waiter)


@dataclass(frozen=True, slots=True)
class Share:
    """One tenant as the line sees it: slots held, waiters, and slot-seconds held so far."""

    name: str
    weight: float
    active: int
    queued: int
    slot_s: float


class _Account:
    """One tenant, across its bands."""

    __slots__ = ("active", "blocked", "hold_s", "max_active", "name", "queued", "slot_s", "weight")

    def __init__(self, tenant: Tenant, hold_s: float) -> None:
        self.name = tenant.name
        self.weight = tenant.weight
        self.max_active = tenant.max_active
        self.active = 0  # slots held
        self.queued = 0  # live waiters
        self.slot_s = 0.0  # slot-seconds held, over its lifetime
        self.hold_s = hold_s  # moving average of its holds
        #: Its flows passed over for being at max_active; keyed again when a slot comes back.
        self.blocked: list[_Flow] = []

    def adopt(self, tenant: Tenant) -> bool:
        """Take a reloaded tenant's figures; True when it may now hold more."""
        more = self.max_active is not None and (
            tenant.max_active is None or tenant.max_active > self.max_active
        )
        self.weight = tenant.weight
        self.max_active = tenant.max_active
        return more


class _Band:
    __slots__ = ("busy", "flows", "heap", "level", "queued", "vt")

    def __init__(self, level: int) -> None:
        self.level = level
        self.heap: list[tuple[float, int, _Flow]] = []
        self.queued = 0  # live waiters
        self.vt = 0.0  # the virtual time of the latest grant
        self.flows = 0  # flows ever made in it, for the heap's bound
        self.busy = 0  # flows with live waiters


class _Flow:
    """One tenant's waiters in one band."""

    __slots__ = (
        "account", "band", "blocked", "entry", "front", "line", "live", "pending", "running",
        "tenant", "vt",
    )  # fmt: skip

    def __init__(self, tenant: Tenant, account: _Account, band: _Band) -> None:
        self.tenant = tenant  # the latest seen, for the push cache
        self.account = account
        self.band = band
        self.line: deque[Waiter] = deque()
        self.front: deque[Waiter] = deque()  # put back by push_front, ahead of `line`
        self.live = 0
        self.vt = band.vt
        #: Provisional charges of its grants still running (in `vt`), and how many they are.
        self.pending = 0.0
        self.running = 0
        self.entry: tuple[float, int, _Flow] | None = None  # its valid heap entry
        self.blocked = False

    def __lt__(self, other: _Flow) -> bool:
        return False  # heap entries of equal (vt, seq): either will do

    def seq_hint(self) -> int:
        """The arrival number of its first waiter (a leaver's, possibly): ties between flows."""
        head = self.front[0] if self.front else self.line[0] if self.line else None
        return head.seq if head is not None else 0


class FairLine(Generic[W]):
    """Waiters in bands, tenants and arrival order; see the module's docstring."""

    #: Any tenant's request leaves a fair line as it is (`Line.solo`).
    solo: Tenant | None = None

    def __init__(self, hold_s: float = INITIAL_HOLD_S) -> None:
        self._bands: dict[int, _Band] = {}
        self._levels: list[int] = []  # descending
        self._accounts: dict[str, _Account] = {}
        self._flows: dict[tuple[int, str], _Flow] = {}
        self._charges: dict[int, tuple[_Flow, float]] = {}  # granted seq -> its flow, charge
        self._hold_s = hold_s  # every tenant's holds: a new tenant's first estimate
        self._last: _Flow | None = None  # the flow of the latest push
        self._picked: _Flow | None = None  # whose head `head` found, until anything changes
        self._handed: W | None = None  # what pop_head gave out last, and its flow
        self._handed_flow: _Flow | None = None
        #: Live waiters in all.
        self.queued = 0

    def __len__(self) -> int:
        return self.queued

    def widen(self, tenant: Tenant, holders: Iterable[W], hold_s: float) -> Line:
        """Already fair: it stays the line (`Line.widen`)."""
        return self  # type: ignore[return-value]  # a FairLine of tickets is a Line

    # -- reading -----------------------------------------------------------------------------

    def counts(self, name: str) -> tuple[int, int]:
        """(slots held, live waiters) of the tenant `name`."""
        account = self._accounts.get(name)
        return (account.active, account.queued) if account is not None else (0, 0)

    def share(self, name: str) -> Share:
        a = self._accounts.get(name)
        if a is None:
            return Share(name, 1.0, 0, 0, 0.0)
        return Share(a.name, a.weight, a.active, a.queued, a.slot_s)

    def busy(self, level: int) -> int:
        """How many tenants have waiters in the band `level`."""
        band = self._bands.get(level)
        return band.busy if band is not None else 0

    def position(self, ticket: W) -> int:
        """About how many grants until `ticket`'s (1 for the next): everyone waiting in higher
        bands, then its place in its tenant's flow times the tenants waiting in its band."""
        flow = self._flows.get((ticket.band, ticket.tenant.name))
        if flow is None or not flow.live:
            return min(1, self.queued)
        ahead = sum(band.queued for band in self._bands.values() if band.level > ticket.band)
        head = flow.front[0] if flow.front else flow.line[0]
        place = 1 if ticket in flow.front else min(max(ticket.seq - head.seq + 1, 1), flow.live)
        return min(ahead + 1 + (place - 1) * flow.band.busy, self.queued)

    def shares(self) -> list[Share]:
        return [
            Share(a.name, a.weight, a.active, a.queued, a.slot_s) for a in self._accounts.values()
        ]

    def tickets(self) -> Iterator[W]:
        """Every ticket in the line, those that left included (their futures are done)."""
        for flow in list(self._flows.values()):
            yield from flow.front  # type: ignore[misc]  # only W are ever pushed
            yield from flow.line  # type: ignore[misc]

    def head(self) -> W | None:
        """The waiter a free slot goes to, or None when nobody who may run is waiting."""
        picked = self._picked
        if picked is not None:
            return picked.front[0] if picked.front else picked.line[0]  # type: ignore[return-value]
        bands = self._bands
        for level in self._levels:
            band = bands[level]
            if not band.queued:
                continue
            heap = band.heap
            while heap:
                entry = heap[0]
                flow = entry[2]
                if flow.entry is not entry:
                    heapq.heappop(heap)
                    continue
                if flow.front:
                    head = self._live_head(flow)
                else:
                    line = flow.line
                    head = line[0] if line else None
                    if head is not None:
                        future = head._future
                        if future is not None and future.done():
                            head = self._live_head(flow)
                if head is None:
                    flow.entry = None
                    heapq.heappop(heap)
                    continue
                key = _FRONT if flow.front else flow.vt
                if entry[0] != key or entry[1] != head.seq:
                    # The flow moved on (a grant, a later head) since it was keyed: its entry
                    # was a lower bound; put it where it now belongs.
                    flow.entry = (key, head.seq, flow)
                    heapq.heapreplace(heap, flow.entry)
                    continue
                account = flow.account
                limit = account.max_active
                if limit is not None and account.active + head.weight > limit:
                    # Passed over until one of its slots comes back (`released`).
                    flow.entry = None
                    flow.blocked = True
                    account.blocked.append(flow)
                    heapq.heappop(heap)
                    continue
                self._picked = flow
                return head  # type: ignore[return-value]
        return None

    def first(self, usable: Callable[[W], bool], scan: int) -> W | None:
        """The waiter a free slot would go to among those `usable` (one passed over by the
        head), or None: bands from the highest, flows by their turn, each flow's first usable
        waiter within its first `scan`; a tenant at its max_active is passed over."""
        for level in self._levels:
            band = self._bands[level]
            if not band.queued:
                continue
            flows = [f for f in self._flows.values() if f.band is band and f.live and not f.blocked]
            flows.sort(key=lambda f: (_FRONT if f.front else f.vt, f.seq_hint()))
            for flow in flows:
                account = flow.account
                limit = account.max_active
                for waiter in itertools.islice(itertools.chain(flow.front, flow.line), scan):
                    if done(waiter) or not usable(waiter):  # type: ignore[arg-type]
                        continue
                    if limit is None or account.active + waiter.weight <= limit:
                        return waiter  # type: ignore[return-value]
                    break  # its tenant's first usable one waits for its own slots: all do
        return None

    # -- changing ----------------------------------------------------------------------------

    def take(self, ticket: W) -> None:
        """Grant `ticket` out of turn (`first` found it, among the first waiters of its flow);
        its future is settled by the caller."""
        flow = self._flows[(ticket.band, ticket.tenant.name)]
        # Out of its flow at once: a failover puts it back at the front, and it must not be in
        # the line twice. Its flow's heap entry may now name it: `head` keys the flow again.
        if ticket in flow.front:
            flow.front.remove(ticket)
        else:
            flow.line.remove(ticket)
        self._count(flow, -1)
        if not flow.live:
            flow.entry = None
        self.granted(ticket)

    def push(self, ticket: W) -> None:
        """A new waiter, at the back of its tenant's flow in its band."""
        flow = self._last
        if flow is None or flow.tenant is not ticket.tenant or flow.band.level != ticket.band:
            flow = self._flow(ticket, adopt=True)
            self._last = flow
        band = flow.band
        if not flow.live:
            flow.line.clear()  # only leavers' tickets, if anything
            flow.front.clear()
            band.busy += 1
            if flow.vt < band.vt:
                flow.vt = band.vt  # back from idle: no credit banked
        flow.line.append(ticket)
        flow.live += 1
        flow.account.queued += 1
        band.queued += 1
        self.queued += 1
        self._picked = None
        if flow.entry is None and not flow.blocked:
            self._key(flow)

    def push_front(self, ticket: W) -> None:
        """A waiter put back (a failover): the next of its band to be served."""
        flow = self._flow(ticket, adopt=False)
        flow.front.appendleft(ticket)
        self._count(flow, 1)
        if not flow.blocked:
            self._key(flow)

    def pop_head(self) -> W:
        """Take the waiter `head` names out of the line (to grant it); IndexError if none."""
        flow = self._picked
        if flow is None:
            if self.head() is None:
                raise IndexError("pop from an empty fair line")
            flow = self._picked
            assert flow is not None  # noqa: S101 - set by head
        self._picked = None
        ticket = flow.front.popleft() if flow.front else flow.line.popleft()
        flow.live -= 1
        flow.account.queued -= 1
        flow.band.queued -= 1
        self.queued -= 1
        # Its entry stays: the flow's key only rose (a later head, and `granted`'s charge),
        # and `head` moves an entry that is too early when it reaches the top.
        if not flow.live:
            flow.entry = None
            flow.band.busy -= 1
        self._handed = ticket  # type: ignore[assignment]
        self._handed_flow = flow
        return ticket  # type: ignore[return-value]

    def grant_head(self) -> W:
        """`pop_head` and `granted`: the head out of the line, granted (`Line.grant_head`)."""
        ticket = self.pop_head()
        self.granted(ticket)
        return ticket

    def granted(self, ticket: W) -> None:
        """`ticket` got its slots (from `pop_head`, or at once with nobody waiting)."""
        flow = self._handed_flow
        if ticket is self._handed and flow is not None:
            self._handed = None
        else:
            flow = self._flow(ticket, adopt=True)
            if flow.vt < flow.band.vt:
                flow.vt = flow.band.vt  # admitted without waiting: as if back from idle
        band = flow.band
        # The band's clock follows what grants started at, counting only holds that ended: a
        # provisional charge may be far off (the first estimate of a hold is a guess), and a
        # clock run ahead on a guess would put a tenant that comes back behind the others.
        start = flow.vt - flow.pending
        if start > band.vt:
            band.vt = start
        account = flow.account
        account.active += ticket.weight
        charge = account.hold_s * ticket.weight / account.weight
        flow.vt += charge
        flow.pending += charge
        flow.running += 1
        self._charges[ticket.seq] = (flow, charge)
        self._picked = None

    def released(self, ticket: W, held_s: float | None) -> None:
        """`ticket` gave its slots back after `held_s` (None: before its waiter resumed)."""
        found = self._charges.pop(ticket.seq, None)
        if found is None:
            return
        flow, charge = found
        account = flow.account
        account.active -= ticket.weight
        held_s = held_s if held_s is not None and held_s > 0 else 0.0
        slot_s = held_s * ticket.weight
        account.slot_s += slot_s
        correction = slot_s / account.weight - charge
        flow.vt += correction
        flow.running -= 1
        flow.pending = flow.pending - charge if flow.running else 0.0
        if held_s:
            # The provisional charge is the hold clock's average, kept per tenant.
            account.hold_s = ewma(account.hold_s, held_s)
            self._hold_s = ewma(self._hold_s, held_s)
        if correction < 0 and flow.entry is not None:
            self._key(flow)  # earlier than its entry says: keyed again at once
        if account.blocked and (account.max_active is None or account.active < account.max_active):
            self._unblock(account)
        self._picked = None

    def leave(self, ticket: W) -> None:
        """A waiter's future is done other than by a grant (gave up, refused): uncount it now;
        its ticket is dropped when it reaches its flow's head (or now, from the tail)."""
        flow = self._flows.get((ticket.band, ticket.tenant.name))
        if flow is None:
            return
        self._count(flow, -1)
        self._picked = None
        if not flow.live:
            flow.line.clear()
            flow.front.clear()
            flow.entry = None
            return
        flow.line = trimmed(flow.line, flow.live)

    def drain(self) -> list[W]:
        """Every live waiter, taken out of the line (shutdown); the slots held stay counted."""
        live = [ticket for ticket in self.tickets() if not done(ticket)]
        for flow in self._flows.values():
            flow.line.clear()
            flow.front.clear()
            flow.entry = None
            flow.live = 0
            flow.blocked = False
        for band in self._bands.values():
            band.heap.clear()
            band.queued = band.busy = 0
        for account in self._accounts.values():
            account.queued = 0
            account.blocked.clear()
        self.queued = 0
        self._picked = None
        return live

    def retune(self, tenants: Iterable[Tenant]) -> list[W]:
        """Take reloaded tenants' weights and limits (API_KEYS_FILE on SIGHUP); the live
        waiters that ask more slots than their tenant's max_active now: they can never run."""
        limits: dict[str, int] = {}
        for tenant in tenants:
            account = self._accounts.get(tenant.name)
            if account is not None and account.adopt(tenant):
                self._unblock(account)
            if tenant.max_active is not None:
                limits[tenant.name] = tenant.max_active
        self._picked = None
        if not limits:
            return []
        return [
            waiter
            for waiter in self.tickets()
            if not done(waiter)
            and (limit := limits.get(waiter.tenant.name)) is not None
            and waiter.weight > limit
        ]

    # -- internals ---------------------------------------------------------------------------

    def _flow(self, ticket: W, adopt: bool) -> _Flow:
        tenant = ticket.tenant
        flow = self._flows.get((ticket.band, tenant.name))
        if flow is None:
            flow = self._make(tenant, ticket.band)
        elif adopt and flow.tenant is not tenant:
            flow.tenant = tenant
            if flow.account.adopt(tenant):
                self._unblock(flow.account)
        return flow

    def _make(self, tenant: Tenant, level: int) -> _Flow:
        account = self._accounts.get(tenant.name)
        if account is None:
            account = self._accounts[tenant.name] = _Account(tenant, self._hold_s)
        band = self._bands.get(level)
        if band is None:
            band = self._bands[level] = _Band(level)
            bisect.insort(self._levels, level, key=lambda level: -level)
        band.flows += 1
        flow = self._flows[(level, tenant.name)] = _Flow(tenant, account, band)
        return flow

    def _count(self, flow: _Flow, change: int) -> None:
        if not flow.live:
            flow.band.busy += 1
        flow.live += change
        if not flow.live:
            flow.band.busy -= 1
        flow.account.queued += change
        flow.band.queued += change
        self.queued += change
        self._picked = None

    def _key(self, flow: _Flow) -> None:
        """Put the flow in its band's heap at its current key (an older entry goes stale)."""
        head = flow.front[0] if flow.front else flow.line[0]
        entry = flow.entry = (_FRONT if flow.front else flow.vt, head.seq, flow)
        band = flow.band
        heap = band.heap
        heapq.heappush(heap, entry)
        if len(heap) > 2 * band.flows + 64:
            band.heap = [e for e in heap if e[2].entry is e]
            heapq.heapify(band.heap)

    def _live_head(self, flow: _Flow) -> Waiter | None:
        front = flow.front
        while front and done(front[0]):
            front.popleft()
        if front:
            return front[0]
        line = flow.line
        while line and done(line[0]):
            line.popleft()
        return line[0] if line else None

    def _unblock(self, account: _Account) -> None:
        blocked, account.blocked = account.blocked, []
        for flow in blocked:
            flow.blocked = False
            if flow.live and flow.entry is None:
                if flow.vt < flow.band.vt:
                    flow.vt = flow.band.vt  # held back by its own limit: no credit banked
                self._key(flow)
        self._picked = None
