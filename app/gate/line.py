"""The line: who waits for slots, in which order, and how deep it may grow.

Standard library only. `Line` is what the admission core asks of any order; `FifoLine` is
first come first served for one tenant, `FairLine` (app/gate/fairline.py) the fair order
between tenants and bands. The core starts with a `FifoLine` and swaps it for a `FairLine`
for good when a second tenant (or a tenant with limits) comes (`Line.widen`).

The core calls a line on its own loop, without an await between the calls of one operation:
`push` (a new waiter), `head` and `grant_head` (the next to grant), `first` and `take` (one
granted out of turn), `granted` (every grant, also of a request that did not wait),
`released` (every granted ticket, once), `leave` (a waiter whose future is done other than
by a grant). A waiter that gives up is uncounted at once (`queued`) and dropped when it
reaches the head (most who give up are the newest and are dropped from the tail at once).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from slotgate.gate.fairline import FairLine, Share
from slotgate.gate.waiter import trimmed

if TYPE_CHECKING:
    from slotgate.gate.tenants import Tenant
    from slotgate.gate.ticket import Ticket


class Line(Protocol):
    """An order of waiting tickets, as the admission core uses it."""

    #: Live waiters (those that gave up or were refused no longer count).
    queued: int

    @property
    def solo(self) -> Tenant | None:
        """The one tenant whose requests leave the line as it is (None: any may change it)."""

    def widen(self, tenant: Tenant, holders: Iterable[Ticket], hold_s: float) -> Line:
        """The line to use from now on, with a request of `tenant` coming; `holders` are the
        tickets granted so far, `hold_s` the average hold."""

    def push(self, ticket: Ticket) -> None: ...
    def push_front(self, ticket: Ticket) -> None: ...
    def head(self) -> Ticket | None: ...
    def grant_head(self) -> Ticket:
        """Take the waiter `head` names out of the line, counted as granted."""

    def first(self, usable: Callable[[Ticket], bool], scan: int) -> Ticket | None: ...
    def take(self, ticket: Ticket) -> None: ...
    def granted(self, ticket: Ticket) -> None: ...
    def released(self, ticket: Ticket, held_s: float | None) -> None: ...
    def leave(self, ticket: Ticket) -> None: ...
    def drain(self) -> list[Ticket]: ...
    def tickets(self) -> Iterator[Ticket]: ...
    def position(self, ticket: Ticket) -> int: ...
    def counts(self, name: str) -> tuple[int, int]: ...
    def share(self, name: str) -> Share: ...
    def busy(self, level: int) -> int: ...
    def retune(self, tenants: Iterable[Tenant]) -> list[Ticket]:
        """Take reloaded tenants; the waiters that can never run under their new limits."""


class FifoLine:
    """One tenant's waiters, first come first served: a deque of tickets; O(1) amortised per
    push, grant and leave, at a cost that does not grow with the depth.

    A waiter that gives up is not searched for: it stops counting in `queued` and `head`
    drops it when it reaches the front. When such leftovers outnumber the live waiters the
    deque is rebuilt without them, so memory stays bounded.
    """

    __slots__ = ("_holders", "_line", "queued", "solo")

    def __init__(self, holders: dict[Ticket, tuple[float, int]]) -> None:
        self._line: deque[Ticket] = deque()
        self._holders = holders  # the core's, read only for `counts`
        self.queued = 0
        self.solo: Tenant | None = None

    def __len__(self) -> int:
        return self.queued

    def widen(self, tenant: Tenant, holders: Iterable[Ticket], hold_s: float) -> Line:
        """The first request: its tenant may have the line to itself. Any other: the line
        becomes a fair one, with whoever waits in it, in their order."""
        if self.solo is None and tenant.max_active is None and tenant.max_queued is None:
            self.solo = tenant
            return self
        fair: FairLine[Ticket] = FairLine(hold_s)
        # What runs now is the solo tenant's: granted in the fair line as if just now, so that
        # it counts against the tenant's limits (a reload may set them) and its release
        # replaces the provisional charge by the real hold, as for any grant.
        for ticket in holders:
            fair.granted(ticket)
        for ticket in self._line:
            if not _gone(ticket):
                fair.push(ticket)
        self._line.clear()
        return fair

    # -- reading -----------------------------------------------------------------------------

    def head(self) -> Ticket | None:
        line = self._line
        while line:
            ticket = line[0]
            future = ticket._future
            if future is None or not future.done():
                return ticket
            line.popleft()  # gave up or refused: its count is settled already
        return None

    def first(self, usable: Callable[[Ticket], bool], scan: int) -> Ticket | None:
        """The first live waiter `usable` among the first `scan` (bounded, so that a release
        behind a long line of heavy waiters stays cheap)."""
        for ticket in itertools.islice(self._line, scan):
            if not _gone(ticket) and usable(ticket):
                return ticket
        return None

    def tickets(self) -> Iterator[Ticket]:
        """Every ticket in the line, those that left included (their futures are done)."""
        return iter(self._line)

    def position(self, ticket: Ticket) -> int:
        head = self.head()  # those who left ahead of it do not count
        if head is None or ticket.seq < head.seq:
            return 0
        return min(ticket.seq - head.seq + 1, self.queued)

    def counts(self, name: str) -> tuple[int, int]:
        solo = self.solo
        if solo is None or solo.name != name:
            return 0, 0
        return sum(weight for _, weight in self._holders.values()), self.queued

    def share(self, name: str) -> Share:
        active, queued = self.counts(name)
        return Share(name, 1.0, active, queued, 0.0)

    def busy(self, level: int) -> int:
        solo = self.solo
        return int(bool(self.queued) and solo is not None and solo.band == level)

    # -- changing ----------------------------------------------------------------------------

    def push(self, ticket: Ticket) -> None:
        self._line.append(ticket)
        self.queued += 1

    def push_front(self, ticket: Ticket) -> None:
        self._line.appendleft(ticket)
        self.queued += 1

    def grant_head(self) -> Ticket:
        """Take the waiter `head` names out of the line (to grant it)."""
        self.queued -= 1
        return self._line.popleft()

    def take(self, ticket: Ticket) -> None:
        """Grant `ticket` out of turn (`first` found it): out of the line at once, as a
        reroute puts it back at the head and it must not be in it twice."""
        self._line.remove(ticket)
        self.queued -= 1

    def granted(self, ticket: Ticket) -> None:
        """Nothing to account: one tenant holds every slot."""

    def released(self, ticket: Ticket, held_s: float | None) -> None:
        """Nothing to account: one tenant holds every slot."""

    def leave(self, ticket: Ticket) -> None:
        self.queued -= 1
        self._line = trimmed(self._line, self.queued)

    def drain(self) -> list[Ticket]:
        """Every live waiter, taken out of the line (shutdown)."""
        live = [ticket for ticket in self._line if not _gone(ticket)]
        self._line.clear()
        self.queued = 0
        return live

    def retune(self, tenants: Iterable[Tenant]) -> list[Ticket]:
        """Reloaded tenants: the solo one's limits may end its line (the next request of
        anyone makes it fair); its waiters stay in line as they are."""
        solo = self.solo
        if solo is None:
            return []
        for tenant in tenants:
            if tenant.name == solo.name:
                limited = tenant.max_active is not None or tenant.max_queued is not None
                self.solo = None if limited else tenant
        return []


def _gone(ticket: Ticket) -> bool:
    future = ticket._future
    return future is None or future.done()
