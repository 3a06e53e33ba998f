"""`/admission`'s "waiting": the requests in the line, by id, tenant and band, never a key or
a body; read from the proxy's list of waiters when a snapshot is asked for."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import islice
from typing import Any

from slotgate.gate.ticket import Claim
from slotgate.proxy.request import Request

#: The longest-waiting requests shown; the line's length says how many there are in all.
SHOWN = 50


def waiting(
    requests: Mapping[Request, Claim], eta_s: Callable[[int], float], shown: int = SHOWN
) -> list[dict[str, Any]]:
    """The `shown` requests that have waited longest, by their place in the line (1: next);
    `eta_s(position)` says when a slot should free for it."""
    listed: list[tuple[int, dict[str, Any]]] = []
    for request, claim in islice(requests.items(), shown):
        position = claim.position
        listed.append(
            (
                position,
                {
                    "request_id": request.id,
                    "position": position,
                    "tenant": request.tenant.name,
                    # The band it waits in: its tenant's, or the lower one its X-Priority asked for.
                    "band": getattr(claim, "band", request.tenant.band),
                    # Known once requests carry the model they ask for (several models per server).
                    "model": getattr(request, "model", None),
                    "waited_s": round(claim.wait_s, 3),
                    "eta_s": round(eta_s(max(position, 1)), 3),
                },
            )
        )
    listed.sort(key=lambda entry: entry[0])
    return [entry for _, entry in listed]
