"""The one way into admission: `Gate`, which the request path and the app's life hold without
asking which gate it is. `Local` is the core's own (one process, or a replica whose line is not
shared); app/replicas/replica.py's `ReplicaAdmission` is the line shared through Redis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

from slotgate.gate.admission import Admission
from slotgate.gate.tenants import EVERYONE, Tenant
from slotgate.gate.ticket import Claim


class Entry(NamedTuple):
    """What a request enters admission with: the core's `Admission.enter` arguments (its
    docstring says what each means)."""

    weight: int
    cost: int = 0
    weigh: Callable[[int], int] | None = None
    affinity: int | None = None
    tenant: Tenant = EVERYONE
    band: int | None = None
    conversation: int | None = None
    tasks: int = 0


class Gate(Protocol):
    """Admission as the request path and the app's life see it."""

    async def start(self) -> None:
        """Before the first request (and before the upstreams' capacities arrive)."""

    def drain(self) -> None:
        """Shutdown has begun: no new requests; the waiters are turned away."""

    async def close(self) -> None:
        """Once the running requests have ended."""

    async def enter(self, entry: Entry) -> Claim:
        """A claim on the slots: granted, or a place in the line; else the refusal raised."""
        ...

    def enter_now(self, entry: Entry) -> Claim | None:
        """`enter`, when this gate decides without awaiting anything (the core's own always
        does); None when it must await (then call `enter`). A plain call: the request path
        makes no coroutine for the common case of a slot free at once."""
        ...

    def retune(self, tenants: Iterable[Tenant]) -> None:
        """Reloaded tenants: their weights and limits from now on."""

    def pause(self) -> None:
        """An operator holds admission: new requests wait in line, running ones finish."""

    def resume(self) -> None:
        """Admission goes on: the line moves in its order."""

    @property
    def paused(self) -> bool:
        """Between `pause` and `resume`."""
        ...

    def unready(self) -> str | None:
        """Why the gate takes no requests now (`/readyz`), or None."""
        ...

    @property
    def mode(self) -> str:
        """How the line is kept: "local" (in this process alone), else the shared line's mode."""
        ...

    def view(self) -> dict[str, Any]:
        """`/admission`'s "replication": the mode, and the shared line's figures."""
        ...


class Local:
    """The core's own gate: every decision in this process."""

    __slots__ = ("admission",)

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def start(self) -> None:
        return

    def drain(self) -> None:
        self.admission.close()

    async def close(self) -> None:
        return

    async def enter(self, entry: Entry) -> Claim:
        return self.enter_now(entry)

    def enter_now(self, entry: Entry) -> Claim:
        weight, cost, weigh, affinity, tenant, band, conversation, tasks = entry
        return self.admission.enter(
            weight, cost, weigh, affinity,
            tenant=tenant, band=band, conversation=conversation, tasks=tasks,
        )  # fmt: skip

    def retune(self, tenants: Iterable[Tenant]) -> None:
        self.admission.retune(tenants)

    def pause(self) -> None:
        self.admission.pause()

    def resume(self) -> None:
        self.admission.resume()

    @property
    def paused(self) -> bool:
        return self.admission.paused

    def unready(self) -> str | None:
        return None

    @property
    def mode(self) -> str:
        return "local"

    def view(self) -> dict[str, Any]:
        return {"mode": "local"}


__all__ = ["Entry", "Gate", "Local"]
