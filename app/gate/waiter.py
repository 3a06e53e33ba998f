"""What a line reads of a waiting ticket (`Waiter`), and what every line does with waiters that
left: they stay where they are until they reach an end (`trimmed`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from slotgate.gate.tenants import Tenant


class Pending(Protocol):
    def done(self) -> bool: ...


class Waiter(Protocol):
    """What a line reads of a ticket. `weight` is the slots it takes; its tenant's
    `weight` is its share of slot time."""

    @property
    def tenant(self) -> Tenant: ...
    @property
    def band(self) -> int: ...
    @property
    def weight(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def _future(self) -> Pending | None: ...


W = TypeVar("W", bound=Waiter)


def trimmed(line: deque[W], live: int) -> deque[W]:
    """`line` without the leavers at its tail; rebuilt without any when they outnumber the
    `live` waiters, so that memory stays bounded at O(1) amortised per leave."""
    while line and done(line[-1]):
        line.pop()
    if len(line) > 2 * live + 64:
        return deque(waiter for waiter in line if not done(waiter))
    return line


def done(waiter: Waiter) -> bool:
    """It left the line: gave up, was refused, or was granted."""
    future = waiter._future
    return future is not None and future.done()
