"""How one replica stays in the shared line: its heartbeat, the channel its grants arrive on,
falling back when Redis is away (`degrade`) and rejoining when it answers again (`rejoin`).

When Redis is unreachable or slow (no answer within `timeout_s`), the replica is degraded:
with `failure_mode="local"` it gates on its own admission core (alone.py), on a static share of
each upstream (its slots divided by the replicas last seen, at least 1) and of the line, with
tenants, bands and budgets as in one process; with "reject" it refuses new work with
`NotReady` (503). A share is safe only if Redis is away for every replica (it refused or closed
a connection). One that merely gets no answer may be cut off alone while the others fill every
slot Redis does not count for it: so Redis keeps a given-up replica's grants counted for
`kept_s` past its heartbeat's expiry, and until then (by its own clock, from the last heartbeat
Redis took) the replica gates only on the slots it held when it fell back.
It pings Redis meanwhile and, once Redis answers, replaces whatever Redis
holds for it with what it holds (`REJOIN`): its grants and, at the back of the line in their
order, its waiters. The same happens when Redis says it gave this replica up (its heartbeat
expired): Redis never counts what the replica no longer holds, and never loses what it still
does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from slotgate.errors import Down, NotReady, TooLarge
from slotgate.replicas.lua import unset
from slotgate.replicas.ticket import Figures, Mode

if TYPE_CHECKING:
    from slotgate.replicas.shared import SharedAdmission


class Membership:
    """The replica's link with the shared line in Redis."""

    __slots__ = ("_line",)

    def __init__(self, line: SharedAdmission) -> None:
        self._line = line

    async def subscribe(self) -> None:
        await self._line._redis.subscribe(self.on_grant, self.lost)

    def lost(self, exc: BaseException) -> None:
        """The grants' subscription failed."""
        line = self._line
        if not line._closed:
            line._redis.heard(exc)
            self.degrade(str(exc))

    def on_grant(self, data: str) -> None:
        line = self._line
        member, upstream, reason, grant_no, weight = data.split("\t")
        grant = (upstream, reason, int(grant_no), int(weight))
        if line._joining is not None:
            # The rejoin's own dispatch may grant a place whose name its reply has not told yet.
            line._early[member] = grant
            return
        if line.mode is Mode.DEGRADED:
            return  # Redis forgets this place when the replica rejoins; the waiter waits here
        ticket = line._tickets.get(member.split("|", 1)[1])
        if ticket is None or ticket._released:
            return  # it left: its leave (RELEASE) finds it granted and returns the slots
        if ticket.member is None:
            line._early[member] = grant
            return
        if ticket.member != member or ticket.granted:
            return  # a grant to a place the ticket had before a rejoin: Redis forgot it
        if reason == "large":
            line._fail(ticket, TooLarge(line._snapshot(), ticket.least))
            return
        line._granted(ticket, *grant)

    async def keep(self) -> None:
        """The heartbeat in shared mode; while degraded, ping until Redis answers and rejoin."""
        line = self._line
        while not line._closed:
            if line.mode is Mode.SHARED:
                await asyncio.sleep(line._heartbeat_s)
                if line._closed:
                    return
                sent = time.monotonic()
                try:
                    reply = await line._call(
                        "HEARTBEAT",
                        line.replica,
                        line._ttl_ms,
                        line._epsilon,
                        line._kept_ms,
                    )
                except Down as exc:
                    self.degrade(str(exc))
                    continue
                if reply[0] == b"fenced":
                    await self.rejoin()
                else:
                    line._renewed_at = max(line._renewed_at or sent, sent)
                    line._fleet = Figures.parse(reply[1:])
                    self.hear_budgets(reply[7:])
            else:
                await line._redis.renew()
                await asyncio.sleep(min(line._heartbeat_s, 0.2))
                if line._closed:
                    return
                # A ping first: local dispatch waits while a rejoin runs, so only try one
                # once Redis answers.
                if await line._redis.answers():
                    await self.rejoin()
                else:
                    # The slots Redis kept for this replica may have become its share.
                    line._alone.dispatch()

    def hear_budgets(self, raw: Sequence[bytes]) -> None:
        """Budgets Redis holds that this replica has not learned: tell `on_budget`."""
        line = self._line
        if line.on_budget is None:
            return
        for upstream, budget in zip(raw[::2], raw[1::2], strict=True):
            name = upstream.decode()
            if name in line._capacities and name not in line._budgets:
                line.on_budget(name, int(budget))

    async def join(self) -> None:
        await self.subscribe()
        await self.rejoin()

    async def rejoin(self) -> None:
        """Replace what Redis holds for this replica with what it holds; shared mode after."""
        line = self._line
        if line._joining is not None:
            await asyncio.shield(line._joining)
            return
        line._joining = asyncio.get_running_loop().create_future()
        line._epoch += 1
        try:
            if not line._redis.listening:
                try:
                    await self.subscribe()
                except Down as exc:
                    self.degrade(str(exc))
                    line._alone.dispatch()
                    return
            # The core grants nobody while the rejoin runs: its waiters are listed as waiters.
            line._alone.detach()
            grants = [t for t in line._tickets.values() if t.granted]
            waiters = sorted(line._waiters.values(), key=lambda t: t.order)
            args: list[str | int | float] = [
                line.replica, line._ttl_ms, line._epsilon, line._kept_ms,
                len(line._capacities), len(grants), len(waiters),
            ]  # fmt: skip
            for upstream, capacity in line._capacities.items():
                args += (upstream, capacity, line._budgets.get(upstream, ""))
            for t in grants:
                args += (
                    t.member or f"{0:016x}|{t.id}", t.upstream or "", t.weight, t.least, t.tasks,
                    t.cost, t.band, t.tenant, repr(t.share), unset(t.max_active),
                    "\n".join(t.ranking),
                )  # fmt: skip
            for t in waiters:
                tag = "" if t.tag is None else repr(t.tag)
                args += (
                    t.id, t.least, t.tasks, t.cost, "\n".join(t.ranking), t.band, tag, t.tenant,
                    repr(t.share), unset(t.max_active),
                )  # fmt: skip
            line._early.clear()
            sent = time.monotonic()
            try:
                reply = await line._call("REJOIN", *args)
            except Down as exc:
                self.degrade(str(exc))
                # Whatever was released while it ran is free on this replica's share now.
                line._alone.dispatch()
                return
            line._renewed_at = sent
            line._redis.refused = False
            fleet = line._fleet = Figures.parse(reply[:6])
            # Redis may have restarted empty: its count starts again.
            line._last_grant = fleet.granted
            for place, (t, member) in enumerate(zip(waiters, reply[6:], strict=True)):
                # A waiter that left (or was granted locally) while the rejoin ran: Redis holds
                # a place for it that nobody will claim, so give it back.
                if t._released or t.granted:
                    line._spawn(line._release_shared(member.decode(), None))
                    continue
                t.member = member.decode()
                # At the back of the line, in their order.
                t.position = max(fleet.queued - len(waiters) + place + 1, 1)
                t.since = fleet.granted
                early = line._early.pop(t.member, None)
                if early is not None:
                    line._granted(t, *early)
            for t in grants:
                if t.member is None:
                    t.member = f"{0:016x}|{t.id}"
                if t._released:
                    line._spawn(line._release_shared(t.member, None))
                elif not t.granted:  # rerouted while the rejoin ran
                    line._spawn(line._reroute_shared(t, t.member))
            # What is left names places of before the rejoin, or of enters still in flight.
            line._early = {m: e for m, e in line._early.items() if self.in_flight(m)}
            line._alone.reset()
            line.mode = Mode.SHARED
            line._shared.set()
        finally:
            joining, line._joining = line._joining, None
            joining.set_result(None)

    def in_flight(self, member: str) -> bool:
        ticket = self._line._tickets.get(member.split("|", 1)[1])
        return ticket is not None and ticket.member is None

    def degrade(self, why: str = "") -> None:
        """Redis is away: gate on this replica's share until it answers again."""
        line = self._line
        if why:
            line.last_error = why
        if line.mode is Mode.DEGRADED or line._closed:
            return
        line.mode = Mode.DEGRADED
        line._epoch += 1
        line._redis.stale = True
        line._shared.clear()
        line.fallbacks_total += 1
        line._alone.fall_back()
        if line._failure_mode == "reject":
            for t in list(line._waiters.values()):
                line._fail(t, NotReady(line._snapshot(), 1.0))
            return
        line._alone.dispatch()


__all__ = ["Membership"]
