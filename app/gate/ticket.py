"""A request's claim on the admission core (`Claim`), and the core's own kind (`Ticket`): its
place in the line, then its slots."""

from __future__ import annotations

import asyncio
from time import monotonic
from typing import TYPE_CHECKING, Protocol

from slotgate.gate.tenants import EVERYONE, Tenant

if TYPE_CHECKING:
    from slotgate.gate.admission import Admission
    from slotgate.gate.pool import Pool


class Claim(Protocol):
    """What the request path needs of a request's claim on the slots: a `Ticket` of this core,
    or a `ReplicaTicket` when replicas share the line through Redis (app/replicas/replica.py)."""

    @property
    def admitted(self) -> bool: ...
    @property
    def admitted_at(self) -> float | None: ...
    @property
    def weight(self) -> int: ...
    @property
    def wait_s(self) -> float: ...
    @property
    def pool(self) -> Pool | None: ...
    @property
    def position(self) -> int: ...
    async def wait(self) -> None: ...
    def release(self) -> bool: ...
    @property
    def released(self) -> bool: ...
    def reroute(self, known_by: float) -> None: ...
    def recost(self, cost: int) -> None: ...
    async def __aenter__(self) -> Claim: ...
    async def __aexit__(self, *exc_info: object) -> None: ...


class Ticket:
    """One request's claim: a place in the line, then `weight` slots of one pool and `cost`
    tokens of its KV-cache budget until released. `async with ticket:` releases it on every
    way out; an earlier `release()` is fine (a second one does nothing)."""

    __slots__ = (
        "_admission", "_future", "_known_by", "_released", "admitted_at", "affinity", "charged",
        "cost", "costed", "entered_at", "least", "memo", "pool", "rerouted", "seq", "tasks",
        "tenant", "weight",
    )  # fmt: skip

    def __init__(
        self,
        admission: Admission,
        weight: int,
        seq: int,
        cost: int = 0,
        affinity: int | None = None,
        tenant: Tenant = EVERYONE,
        conversation: int | None = None,
        tasks: int = 0,
    ) -> None:
        self._admission = admission
        self.weight = weight
        #: The fewest slots it runs in (its choices); and for a prompt array, the tasks
        #: llama-server makes of it (0 for any other): it runs as many at once as its upstream
        #: has slots, so what it holds is known only where it is granted (`weighs`).
        self.least = weight
        self.tasks = tasks
        #: Whom it is for (app/gate/tenants.py); its band is the band it waits in.
        self.tenant = tenant
        largest = admission._largest_budget
        self.cost = cost if largest is None else min(cost, largest)
        #: The cost was estimated against a budget (False: it entered before any bound, so
        #: what it takes is unknown).
        self.costed = admission._budgeted
        self.affinity = affinity
        #: The key its upstream is remembered by: its conversation's, else its affinity key.
        self.memo = conversation if conversation is not None else affinity
        self.seq = seq
        self.entered_at = monotonic()
        self.admitted_at: float | None = None
        #: The pool it holds (or was handed) slots of, and the tokens it holds there.
        self.pool: Pool | None = None
        self.charged = 0
        self.rerouted = False
        self._future: asyncio.Future[None] | None = None
        self._known_by: float | None = None
        self._released = False

    @property
    def admitted(self) -> bool:
        return self.admitted_at is not None

    @property
    def band(self) -> int:
        return self.tenant.band

    @property
    def released(self) -> bool:
        """Its slots (or its place) were given back."""
        return self._released

    @property
    def granted(self) -> bool:
        """The slots are this ticket's, even if its waiter has not resumed yet."""
        return self.pool is not None

    @property
    def wait_s(self) -> float:
        return (self.admitted_at or monotonic()) - self.entered_at

    def weighs(self, capacity: int) -> int:
        """The slots it holds on a pool of `capacity` (more than that if it cannot run there)."""
        tasks = self.tasks
        return self.weight if not tasks else max(self.least, min(tasks, capacity))

    @property
    def position(self) -> int:
        """1-based place in the line (approximate after cancellations ahead); 0 once admitted."""
        if self.admitted:
            return 0
        return self._admission._line.position(self)

    async def wait(self) -> None:
        """Wait for the slots; on any exit without them, leave the line at once."""
        if self.admitted:
            return
        admission = self._admission
        future = self._future
        assert future is not None  # noqa: S101 - set by Admission.enter for every waiter
        try:
            if admission._capacity is None and (admission._startup_wait_s or self._known_by):
                await self._until_known()
            if admission._queue_timeout_s is None or self._known_by is not None:
                # No scope at all without QUEUE_TIMEOUT_S (the default): an idle timeout scope
                # costs more than the whole hand-off it would wrap. A ticket sent back by its
                # upstream waits at the head of the line, not under the queue timeout again.
                await future
            else:
                async with asyncio.timeout_at(admission._deadline(self.entered_at)):
                    await future
        except BaseException as exc:
            self.release()
            if isinstance(exc, TimeoutError):
                raise admission._timed_out() from None
            raise
        if not self._released:
            self.admitted_at = monotonic()

    async def _until_known(self) -> None:
        """Wait in line while no capacity is known, for at most the startup wait (and the
        queue timeout, when shorter) or until the ticket's own `known_by`; NotReady past it if
        none is known yet."""
        admission = self._admission
        future = self._future
        assert future is not None  # noqa: S101 - set by enter for every waiter
        if self._known_by is not None:
            deadline = self._known_by
        else:
            bound_s = admission._startup_wait_s or 0.0
            if admission._queue_timeout_s is not None:
                bound_s = min(bound_s, admission._queue_timeout_s)
            deadline = self.entered_at + bound_s
        admission._awaiting_known += 1
        try:
            while admission._capacity is None and not future.done():
                remaining = deadline - monotonic()
                if remaining <= 0:
                    raise admission._not_ready()
                # asyncio.wait, not a timeout scope: the future must survive the timeout, as
                # the waiter stays in line once a capacity is known.
                await asyncio.wait((future,), timeout=remaining)
        finally:
            admission._awaiting_known -= 1

    def reroute(self, known_by: float) -> None:
        """Its upstream did not take the request (refused, down, restarting): give its slots
        back and wait again at the head of the line, for whichever upstream has room first;
        `wait` fails with NotReady if none is known by `known_by` (time.monotonic())."""
        pool = self.pool
        if self._released or pool is None:
            return
        self._admission._reroute(self, pool, known_by)

    def recost(self, cost: int) -> None:
        """Reserve `cost` tokens of the budget instead (a better count came in), in line or
        admitted; a lower cost may let the line move at once."""
        if self._released:
            return
        largest = self._admission._largest_budget
        self.cost = cost if largest is None else min(cost, largest)
        self.costed = True
        pool = self.pool
        if pool is not None:
            charge = pool.charge(self)
            pool.committed += charge - self.charged
            self.charged = charge
        self._admission._dispatch()

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> bool:
        """Give the slots back, or the place in the line; calling it twice is harmless.

        True when the release handed slots to a waiter.
        """
        if self._released:
            return False
        self._released = True
        admission = self._admission
        pool = self.pool
        if pool is not None:
            # Admitted, or handed the slots while its waiter was giving up, before it could
            # resume: pass them on, or they leak.
            pool.committed -= self.charged
            admitted_at = self.admitted_at
            hold_s = None if admitted_at is None else monotonic() - admitted_at
            admission._line.released(self, hold_s)
            return admission._release(self, pool, self.weight, hold_s)
        future = self._future
        if future is None:
            return False
        # Refused by resize or close (an exception set) means already out of the count.
        counted = not future.done() or future.cancelled()
        future.cancel()
        admission._leave(self, counted)
        return False
