"""`/admission`'s "waiting": the requests in the line, by id, tenant and band, never a key or
a body; read from the proxy's registry of requests under way (app/proxy/watch.py's `Running`)
when a snapshot is asked for, so that a request pays nothing for it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slotgate.gate.ticket import Claim
    from slotgate.proxy.request import Request
    from slotgate.proxy.watch import Watch

#: The longest-waiting requests shown; the line's length says how many there are in all.
SHOWN = 50


def waiting(
    running: Iterable[Watch], eta_s: Callable[[int], float], shown: int = SHOWN
) -> list[dict[str, Any]]:
    """The `shown` requests that have waited longest, by their place in their line (1: next).
    A request's ETA (when a slot should free for it) and its model are its own line's: its
    model's (`request.lane`) with one line per model, else `eta_s(position)`, the gate's."""
    listed: list[tuple[int, dict[str, Any]]] = []
    for request, claim in islice(_waiters(running), shown):
        position = claim.position
        lane = request.lane
        eta = eta_s if lane is None else lane.admission.eta_s
        listed.append(
            (
                position,
                {
                    "request_id": request.id,
                    "position": position,
                    "tenant": request.tenant.name,
                    # The band it waits in: its tenant's, or the lower one its X-Priority asked for.
                    "band": getattr(claim, "band", request.tenant.band),
                    "model": None if lane is None else lane.model,
                    "waited_s": round(claim.wait_s, 3),
                    "eta_s": round(eta(max(position, 1)), 3),
                },
            )
        )
    listed.sort(key=lambda entry: entry[0])
    return [entry for _, entry in listed]


def _waiters(running: Iterable[Watch]) -> Iterator[tuple[Request, Claim]]:
    """Those of the requests under way that wait for slots, in the order they came (the
    registry's): the first found have waited longest. Walked only as far as `shown` waiters,
    past at most the requests running meanwhile (as many as the slots)."""
    for watch in running:
        request = watch.request
        if request is None:
            continue
        claim = request.ticket
        if claim is not None and not claim.admitted:
            yield request, claim
