"""Deadlines per request: how long a request may wait for its slot (`X-Max-Wait` in seconds, or
its tenant's `max_wait_s`), so that a client that cannot use a late answer is told at once,
rather than after waiting in vain.

Standard library only. Two moments decide: on entering the line, a request whose estimated
wait (the hold clock's `eta_s` for its place) already exceeds its bound is refused there and
then; a request still waiting when its bound runs out leaves the line. Both are DeadlineUnmet
(503 `deadline_unmet`, with the estimate and a Retry-After for when the line should have
shortened enough). A request without a bound costs nothing here: the request path asks only
when one is set.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable

from slotgate.errors import BadRequest, DeadlineUnmet

#: The longest bound a request may give: a day, past which it means nothing.
MAX_WAIT_S = 86400.0
#: A number of seconds as X-Max-Wait gives it: "5", "2.5", ".5".
_SECONDS = re.compile(rb"[ \t]*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[ \t]*")


def max_wait_s(header: bytes | None, default: float | None) -> float | None:
    """A request's bound: its X-Max-Wait (seconds, a number from 0), else its tenant's; None for
    neither. A value that is not a number is refused: a client that sets one counts on it."""
    if header is None:
        return default
    # Digits and a point only: float() alone would also take "1_0", "1e1" and "-0".
    value = float(header) if _SECONDS.fullmatch(header) else math.nan
    if not 0 <= value <= MAX_WAIT_S:
        raise BadRequest(
            f"X-Max-Wait must be a number of seconds from 0 to {MAX_WAIT_S:.0f}",
            param="X-Max-Wait",
        )
    return value


def check(eta_s: float, bound_s: float, waited_s: float = 0.0) -> None:
    """Raise DeadlineUnmet when a request that waited `waited_s` would be given a slot only
    past its bound."""
    if waited_s + eta_s > bound_s:
        raise DeadlineUnmet(bound_s, eta_s, waited_s)


async def within(
    waiting: Awaitable[None], bound_s: float, waited_s: float, eta_s: Callable[[], float]
) -> None:
    """Await `waiting` (a wait for a slot, which leaves the line when cancelled) until a
    request that has waited `waited_s` reaches its bound; then DeadlineUnmet, with the estimate
    of what it would still have waited."""
    scope = asyncio.timeout(max(bound_s - waited_s, 0.0))
    try:
        async with scope:
            await waiting
    except TimeoutError:
        if not scope.expired():
            raise
        raise DeadlineUnmet(bound_s, eta_s(), bound_s) from None
