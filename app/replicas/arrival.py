"""A request's arrival in the shared line: the ENTER script's call, and what its reply means (a
grant, a place in the line, or a refusal). SharedAdmission (app/replicas/shared.py) owns the
tickets; this changes them only synchronously, on its one event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from slotgate.errors import NotReady, QueueFull, Stale, TenantQueueFull, TooLarge
from slotgate.gate.fairline import Share
from slotgate.replicas.lua import unset
from slotgate.replicas.ticket import Figures, SharedTicket

if TYPE_CHECKING:
    from slotgate.replicas.shared import SharedAdmission


class Arrival:
    """How a ticket enters the shared line in Redis."""

    __slots__ = ("_line",)

    def __init__(self, line: SharedAdmission) -> None:
        self._line = line

    async def enter(self, ticket: SharedTicket) -> SharedTicket:
        """Into the shared line: granted, or a place in it; else the refusal raised (`Stale`: a
        rejoin ran meanwhile, try again; `Down`: Redis is away)."""
        line = self._line
        policy = line._policy
        args = (
            line.replica, ticket.id, ticket.weight, ticket.cost, "\n".join(ticket.ranking),
            line._epsilon, ticket.band, "" if ticket.tag is None else repr(ticket.tag),
            unset(policy.max_queue), unset(policy.queue_per_slot), unset(policy.min_queue),
            ticket.tenant, repr(ticket.share), unset(ticket.max_active),
            unset(ticket.max_queued), ticket.tasks,
        )  # fmt: skip
        # The script runs as its own task: a caller cancelled while it runs must not strand
        # what it took in Redis, so whatever it took is handed back when it completes.
        epoch = line._epoch
        task = asyncio.ensure_future(line._call("ENTER", *args))
        # Known before the answer: its grant may be published, and read, before the reply.
        line._tickets[ticket.id] = ticket
        try:
            reply = await asyncio.shield(task)
            return await self._answer(ticket, reply, epoch)
        except BaseException as exc:
            line._tickets.pop(ticket.id, None)
            if isinstance(exc, asyncio.CancelledError):
                if task.done():
                    self._orphan(task, ticket)
                else:
                    task.add_done_callback(lambda t: self._orphan(t, ticket))
            raise

    async def _answer(self, ticket: SharedTicket, reply: list[bytes], epoch: int) -> SharedTicket:
        line = self._line
        kind = reply[0].decode()
        if kind in ("grant", "queued"):
            member = reply[1].decode()
            early = line._early.pop(member, None)
            if epoch != line._epoch or line._joining is not None:
                # A rejoin's list was made while this ran: Redis forgets (or forgot) it.
                line._spawn(line._release_shared(member, None))
                raise Stale
            ticket.member = member
            if kind == "grant":
                line._granted(
                    ticket, reply[2].decode(), reply[3].decode(), int(reply[4]), int(reply[5])
                )
                return ticket
            line._waiters[ticket.id] = ticket
            ticket.position = int(reply[2])
            ticket.since = int(reply[4])
            ticket._future = asyncio.get_running_loop().create_future()
            if early is not None:
                line._granted(ticket, *early)
            return ticket
        if kind == "fenced":
            await line._link.rejoin()
            raise Stale
        if kind == "full":
            line._fleet = Figures.parse(reply[2:])
            queued = line._fleet.queued
            raise QueueFull(line._snapshot(), line._retry_after_s(queued + ticket.weight))
        if kind == "tenant_full":
            line._fleet = Figures.parse(reply[3:])
            queued, active = int(reply[1]), int(reply[2])
            share = Share(ticket.tenant, ticket.share, active, queued, 0.0)
            snapshot = dataclasses.replace(line._snapshot(), tenant=share)
            # A place of its own frees when its first waiter is granted.
            over = queued - (ticket.max_queued or 0) + 1
            raise TenantQueueFull(snapshot, line._retry_after_s(over))
        if kind == "large":
            line._fleet = Figures.parse(reply[2:])
            raise TooLarge(line._snapshot(), ticket.least, int(reply[1]))
        line._fleet = Figures.parse(reply[1:])
        raise NotReady(line._snapshot(), 1.0)

    def _orphan(self, task: asyncio.Future[Any], ticket: SharedTicket) -> None:
        # The caller was cancelled while ENTER ran: whatever it took is handed back.
        line = self._line
        if task.cancelled() or task.exception() is not None:
            return
        reply = task.result()
        if reply[0] in (b"grant", b"queued"):
            member = reply[1].decode()
            line._early.pop(member, None)
            ticket._released = True
            line._spawn(line._release_shared(member, None))


__all__ = ["Arrival"]
