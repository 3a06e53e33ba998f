"""Degraded mode's gating (REDIS_FAILURE_MODE=local): while Redis is away, a replica gates alone,
FIFO on slots, on a static share of each upstream (its slots divided by the replicas last seen,
at least 1) and of the line; while Redis may still count its grants for the others (it only
stopped answering this replica), on the slots it held when it fell back. Tenants' shares and
limits and the token budgets hold in shared mode only.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from slotgate.errors import NotReady, QueueFull, TooLarge
from slotgate.replicas.ticket import Mode, SharedTicket

if TYPE_CHECKING:
    from slotgate.replicas.shared import SharedAdmission


class Alone:
    """One replica's gating on its share while degraded; its state changes only synchronously,
    from its SharedAdmission."""

    __slots__ = ("_line", "active", "kept")

    def __init__(self, line: SharedAdmission) -> None:
        self._line = line
        #: This replica's own slots in use per upstream.
        self.active: dict[str, int] = {}
        #: The slots per upstream Redis still counts for this replica (its grants when it fell
        #: back), while `keeping`.
        self.kept: dict[str, int] = {}

    def fall_back(self, active: dict[str, int]) -> None:
        """Redis is away: `active` is what this replica holds, and what Redis keeps of it."""
        self.active = active
        self.kept = dict(active)

    def free(self, upstream: str, weight: int) -> None:
        self.active[upstream] = max(self.active.get(upstream, 0) - weight, 0)

    def shares(self) -> dict[str, int]:
        line = self._line
        if self.keeping():
            # Cut off from a Redis the others may still reach: only the slots Redis counts
            # for this replica are sure to be nobody else's.
            kept = self.kept
            return {u: min(kept[u], c) for u, c in line._capacities.items() if kept.get(u)}
        n = max(line._fleet.replicas, 1)
        return {u: max(c // n, 1) for u, c in line._capacities.items()}

    def keeping(self) -> bool:
        """Does Redis still count this replica's grants of the fallback, while it may be
        serving the other replicas? Until its lease and the keeping after it have run out
        (by this replica's clock, from the last heartbeat Redis took, less a margin), unless
        Redis refused a connection: then it is down for every replica."""
        line = self._line
        renewed = line._renewed_at
        if renewed is None or line._redis.refused:
            return False
        kept_s = (line._ttl_ms + line._kept_ms) / 1000 - line._timeout_s
        return time.monotonic() < renewed + kept_s

    def limit(self) -> int | None:
        line = self._line
        capacity = sum(line._capacities.values())
        if not capacity:
            return None
        limit = line._policy.limit(capacity)
        if limit is None:
            return None
        return max(limit // max(line._fleet.replicas, 1), 1)

    def enter(self, ticket: SharedTicket) -> SharedTicket:
        line = self._line
        if line._failure_mode == "reject":
            raise NotReady(line._snapshot(), 1.0)
        shares = self.shares()
        if not shares:
            raise NotReady(line._snapshot(), 1.0)
        if ticket.least > max(line._capacities.values()):
            raise TooLarge(line._snapshot(), ticket.least, max(line._capacities.values()))
        if ticket.least > max(shares.values()):
            # It fits an upstream, not this replica's share of one: it may run once Redis is
            # back, so it is refused as for now (503), not as a request to change (400).
            raise NotReady(line._snapshot(), 1.0)
        if not line._waiters:
            upstream, reason = self.choose(ticket, shares)
            if upstream is not None:
                line._tickets[ticket.id] = ticket
                ticket.weight = ticket.weighs(shares[upstream])
                self.active[upstream] = self.active.get(upstream, 0) + ticket.weight
                ticket.upstream, ticket.reason = upstream, reason
                ticket.admitted_at = time.monotonic()
                return ticket
        limit = self.limit()
        if limit is not None and len(line._waiters) >= limit:
            raise QueueFull(line._snapshot(), line._retry_after_s(len(line._waiters) + 1))
        ticket._future = asyncio.get_running_loop().create_future()
        line._tickets[ticket.id] = ticket
        line._waiters[ticket.id] = ticket
        ticket.position = len(line._waiters)
        ticket.since = line._grants()
        return ticket

    def choose(self, ticket: SharedTicket, shares: dict[str, int]) -> tuple[str | None, str]:
        """The same rule as the script's `choose`, over this replica's shares (a prompt array
        weighed on each share: what it may hold of that upstream while this replica gates
        alone)."""
        active = self.active
        w = ticket.weighs(max(shares.values()))
        load = (sum(active.get(u, 0) for u in shares) + w) * (1 + self._line._epsilon)
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

    def dispatch(self) -> None:
        line = self._line
        if line.mode is not Mode.DEGRADED or line._failure_mode == "reject":
            return
        shares = self.shares()
        if not shares:
            # Cut off holding nothing: its waiters keep their places (QUEUE_TIMEOUT_S bounds
            # them) for Redis to answer again, or for the keeping to run out.
            return
        largest = max(shares.values())
        for ticket in sorted(line._waiters.values(), key=lambda t: t.order):
            if ticket.least > largest:
                # Entered while shared: it can never run on a share, and would stop the line.
                line._fail(ticket, NotReady(line._snapshot(), 1.0))
                continue
            upstream, reason = self.choose(ticket, shares)
            if upstream is None:
                return  # the head only: nobody overtakes it
            weight = ticket.weighs(shares[upstream])
            self.active[upstream] = self.active.get(upstream, 0) + weight
            ticket.member = None  # Redis will know it only from the rejoin's list of grants
            line._granted(ticket, upstream, reason, 0, weight)


__all__ = ["Alone"]
