"""Degraded mode's gating (REDIS_FAILURE_MODE=local): while Redis is away, a replica gates on an
admission core of its own (app/gate/admission.py), the one a single process gates on, so that
tenants' shares and limits, bands, KV budgets and routing hold as in one process. Its pools are
this replica's share of each upstream (its slots divided by the replicas last seen, at least 1,
and as much of its KV budget), its line bound the line's divided likewise; while Redis may still
count its grants for the others (it only stopped answering this replica), its pools are the
slots it held when it fell back. What the replica held then is held in the core (`hold`), so
that running requests count.

This module keeps only what the core cannot know: the shares, and the bridge between a
request's SharedTicket and its claim on the core.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from slotgate.errors import AdmissionError, NotReady, QueueFull, TooLarge
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.pool import Pool, Snapshot
from slotgate.gate.tenants import EVERYONE, Tenant
from slotgate.gate.ticket import Ticket
from slotgate.replicas.ticket import Mode, SharedTicket

if TYPE_CHECKING:
    from slotgate.replicas.shared import SharedAdmission

#: A ticket sent back by its upstream without a deadline waits for one this long at most.
_NO_DEADLINE_S = 86400.0


class Alone:
    """One replica's gating on its share while degraded; its state changes only synchronously,
    from its SharedAdmission (or when a waiter's claim on the core is granted)."""

    __slots__ = ("_line", "_tenants", "core", "held", "kept", "waiting")

    def __init__(self, line: SharedAdmission) -> None:
        self._line = line
        #: The slots per upstream Redis still counts for this replica (its grants when it fell
        #: back), while `keeping`.
        self.kept: dict[str, int] = {}
        #: The core's claim of each waiting SharedTicket (by id), with the task that hands its
        #: grant to the SharedTicket.
        self.waiting: dict[str, tuple[Ticket, asyncio.Task[None]]] = {}
        self.reset()

    def reset(self) -> None:
        """A core of nobody's: shared again, Redis counts whatever this replica holds."""
        self.detach()  # a claim on the core of before would never be granted
        # Unbounded: the line's bound is this replica's share of it (`limit`), and waiters of
        # the shared line that move in when it falls back are never refused for it.
        self.core = Admission(QueuePolicy(max_queue=0), epsilon=self._line._epsilon)
        if self._line.paused:
            self.core.pause()
        #: The core's ticket of each SharedTicket granted here (by id).
        self.held: dict[str, Ticket] = {}
        self._tenants: dict[tuple[str, float, int, int | None, int | None], Tenant] = {}

    # -- the share ---------------------------------------------------------------------------

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

    def snapshot(self) -> Snapshot:
        core = self.core.snapshot()
        return Snapshot(
            sum(self.shares().values()) or None,
            core.active,
            len(self._line._waiters),
            self.limit(),
            core.budget_tokens,
            core.committed_tokens,
        )

    def _size(self) -> dict[str, int]:
        """The core's pools follow the shares (and budgets); the shares, for the caller."""
        line = self._line
        shares = self.shares()
        for upstream in line._capacities:
            self._pool(upstream)
        for pool in self.core.pools:
            share = shares.get(pool.key)
            budget = line._budgets.get(pool.key)
            if budget is not None and share is not None:
                budget = max(budget * share // line._capacities[pool.key], 1)
            if pool.capacity != share:
                pool.resize(share)
            if pool.budget != budget:
                pool.resize_budget(budget)
        return shares

    def _pool(self, upstream: str) -> Pool:
        for pool in self.core.pools:
            if pool.key == upstream:
                return pool
        return self.core.add_pool(upstream)

    def _tenant(self, ticket: SharedTicket) -> Tenant:
        """The ticket's tenant as the core knows tenants: one object per name and terms, as
        a roster has (the core tells "the same tenant" by identity)."""
        if not ticket.tenant:
            return EVERYONE
        terms = (ticket.tenant, ticket.share, ticket.band, ticket.max_active, ticket.max_queued)
        tenant = self._tenants.get(terms)
        if tenant is None:
            tenant = self._tenants[terms] = Tenant(*terms)
        return tenant

    # -- falling back, and back ----------------------------------------------------------------

    def fall_back(self) -> None:
        """Redis is away: what this replica holds counts on its share, and is what Redis
        keeps of it."""
        line = self._line
        self.reset()
        granted = [(t, t.upstream) for t in line._tickets.values() if t.upstream is not None]
        kept: dict[str, int] = {}
        for t, upstream in granted:
            kept[upstream] = kept.get(upstream, 0) + t.weight
        self.kept = kept
        self._size()
        for t, upstream in granted:
            self.held[t.id] = self.core.hold(
                self._pool(upstream), t.weight, t.cost, t.affinity,
                tenant=self._tenant(t), conversation=t.conversation,
            )  # fmt: skip

    def detach(self) -> None:
        """A rejoin is about to list this replica's waiters: the core grants none of them
        from now on (each waits in the SharedTicket's own line; `dispatch` enters them again
        should the rejoin fail)."""
        waiting, self.waiting = self.waiting, {}
        for claim, task in waiting.values():
            task.cancel()
            # A release may grant the next waiter of the core: it is let go in its turn.
            claim.release()

    # -- requests ----------------------------------------------------------------------------

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
        ahead = len(line._waiters)
        claim = self._enter(ticket)
        if claim.granted:
            line._tickets[ticket.id] = ticket
            self._granted(ticket, claim)
            return ticket
        limit = self.limit()
        if limit is not None and ahead >= limit:
            claim.release()
            raise QueueFull(line._snapshot(), line._retry_after_s(ahead + 1))
        ticket._future = asyncio.get_running_loop().create_future()
        line._tickets[ticket.id] = ticket
        line._waiters[ticket.id] = ticket
        ticket.position = ahead + 1
        ticket.since = line._grants()
        self._bridge(ticket, claim)
        return ticket

    def dispatch(self) -> None:
        """The core follows the shares; waiters of this replica without a place in it (they
        entered while shared, or a rejoin failed) take one, in their order."""
        line = self._line
        if line.mode is not Mode.DEGRADED or line._failure_mode == "reject":
            return
        shares = self._size()
        if not shares or len(line._waiters) == len(self.waiting):
            # Cut off holding nothing: its waiters keep their places (QUEUE_TIMEOUT_S bounds
            # them) for Redis to answer again, or for the keeping to run out.
            return
        largest = max(shares.values())
        for ticket in sorted(line._waiters.values(), key=lambda t: t.order):
            if ticket.id in self.waiting:
                continue
            if ticket.least > largest:
                # Entered while shared: it can never run on a share, and would stop the line.
                line._fail(ticket, NotReady(line._snapshot(), 1.0))
                continue
            try:
                claim = self._enter(ticket)
            except AdmissionError as exc:
                line._fail(ticket, exc)
                continue
            if claim.granted:
                self._granted(ticket, claim)
            else:
                self._bridge(ticket, claim)

    def free(self, ticket: SharedTicket) -> None:
        """`ticket` is done with: its slots or its place in the core go back (synchronously:
        the core hands them on at once)."""
        waiting = self.waiting.pop(ticket.id, None)
        if waiting is not None:
            claim, task = waiting
            task.cancel()
            claim.release()
        held = self.held.pop(ticket.id, None)
        if held is not None:
            held.release()

    def reroute(self, ticket: SharedTicket) -> None:
        """`ticket`'s upstream did not take it: it waits again at the head of the core's line
        (`Ticket.reroute`); while a rejoin runs, in the SharedTicket's own line."""
        claim = self.held.pop(ticket.id, None)
        if claim is None:
            return
        line = self._line
        if line.mode is not Mode.DEGRADED or line._joining is not None:
            claim.release()
            return
        known_by = ticket._known_by
        claim.reroute(time.monotonic() + _NO_DEADLINE_S if known_by is None else known_by)
        self._bridge(ticket, claim)

    def retune(self, name: str, share: float, max_active: int | None) -> None:
        self.core.retune([Tenant(name, share, max_active=max_active)])

    def rekey(self, old: str, new: str) -> None:
        if old in self.kept:
            self.kept[new] = self.kept.get(new, 0) + self.kept.pop(old)
        for pool in self.core.pools:
            if pool.key == old:
                pool.rename(new)

    def _enter(self, ticket: SharedTicket) -> Ticket:
        return self.core.enter(
            ticket.least, ticket.cost, None, ticket.affinity,
            tenant=self._tenant(ticket), band=ticket.band, conversation=ticket.conversation,
            tasks=ticket.tasks,
        )  # fmt: skip

    def _bridge(self, ticket: SharedTicket, claim: Ticket) -> None:
        task = asyncio.ensure_future(self._wait(ticket, claim))
        self.waiting[ticket.id] = (claim, task)

    async def _wait(self, ticket: SharedTicket, claim: Ticket) -> None:
        """The core's grant (or refusal) handed to the SharedTicket its request waits on
        (which keeps the queue timeout); cancelled by `free` and `detach`."""
        try:
            await claim.wait()
        except AdmissionError as exc:
            self.waiting.pop(ticket.id, None)
            self._line._fail(ticket, exc)
            return
        self.waiting.pop(ticket.id, None)
        self._granted(ticket, claim)

    def _granted(self, ticket: SharedTicket, claim: Ticket) -> None:
        pool = claim.pool
        assert pool is not None  # noqa: S101 - granted
        self.held[ticket.id] = claim
        first = ticket.ranking[0] if ticket.ranking else None
        ticket.member = None  # Redis will know it only from the rejoin's list of grants
        reason = "retry" if claim.rerouted else "affinity" if pool.key == first else "load"
        self._line._granted(ticket, pool.key, reason, 0, claim.weight)


__all__ = ["Alone"]
