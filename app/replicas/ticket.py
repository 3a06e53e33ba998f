"""One request's claim on the shared line (`SharedTicket`), what Redis last said of the line
(`Figures`), and whether the replica shares it (`Mode`). The ticket's state changes only
through its SharedAdmission (app/replicas/shared.py), synchronously, on the one event loop.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slotgate.errors import NotReady, QueueTimeout

if TYPE_CHECKING:
    from slotgate.replicas.shared import SharedAdmission


class Mode(enum.Enum):
    SHARED = "shared"
    #: Redis is away; the replica gates on its share (or refuses, with failure_mode "reject").
    DEGRADED = "degraded"


@dataclass(frozen=True, slots=True)
class Figures:
    """What Redis last said of the shared line, over every replica and upstream."""

    capacity: int = 0
    active: int = 0
    queued: int = 0
    hold_s: float | None = None
    replicas: int = 1
    #: Grants made so far, fleet-wide.
    granted: int = 0

    @classmethod
    def parse(cls, raw: Sequence[bytes]) -> Figures:
        hold = float(raw[3])
        return cls(
            int(raw[0]), int(raw[1]), int(raw[2]), hold if hold >= 0 else None, int(raw[4]),
            int(raw[5]),
        )  # fmt: skip


def name_of(tenant: str) -> str:
    """A tenant's name as Redis keeps it: tabs and newlines separate the fields of a ticket."""
    return tenant.replace("\t", " ").replace("\n", " ")


@dataclass(slots=True, eq=False, repr=False)
class SharedTicket:
    """One request's claim; `async with ticket:` releases it on every way out."""

    _admission: SharedAdmission
    id: str
    #: This replica's own arrival number: the order of its waiters when they rejoin.
    order: int
    #: The slots it holds, known once granted: its `least` until then.
    weight: int
    cost: int
    ranking: tuple[str, ...]
    band: int
    tag: float | None
    #: Its tenant's name ("": none), without tabs or newlines: they separate the fields of a
    #: ticket in Redis.
    tenant: str = ""
    share: float = 1.0
    max_active: int | None = None
    max_queued: int | None = None
    #: A prompt array's tasks (0 for any other request).
    tasks: int = 0
    #: Its routing key and conversation, for this replica's own core while Redis is away
    #: (the shared line goes by `ranking`).
    affinity: int | None = None
    conversation: int | None = None
    #: The fewest slots it runs in.
    least: int = field(init=False)
    #: Its 1-based place in the fleet's line as last known (the ENTER reply's); 0 once
    #: granted.
    position: int = field(default=0, init=False)
    #: The fleet's grants so far when `position` was read: each grant since moves it up.
    since: int = field(default=0, init=False)
    #: `<seq>|<id>` while Redis knows the ticket; a new one each time it (re)joins.
    member: str | None = field(default=None, init=False)
    upstream: str | None = field(default=None, init=False)
    reason: str = field(default="", init=False)
    #: The grant's place among all grants of the fleet (0: granted locally).
    grant_no: int = field(default=0, init=False)
    entered_at: float = field(default_factory=time.monotonic, init=False)
    admitted_at: float | None = field(default=None, init=False)
    _future: asyncio.Future[None] | None = field(default=None, init=False)
    _released: bool = field(default=False, init=False)
    #: Sent back by its upstream (`reroute`), and until when it may wait for one known.
    rerouted: bool = field(default=False, init=False)
    _known_by: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.least = self.weight

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


__all__ = ["Figures", "Mode", "SharedTicket", "name_of"]
