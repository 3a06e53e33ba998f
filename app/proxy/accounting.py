"""What a request leaves behind once it is over: its metrics (app/metrics.py) and its one
access-log line (app/logs.py), both keyed by its `Outcome` (app/outcome.py)."""

from __future__ import annotations

import logging
from time import monotonic

from slotgate.logs import Client
from slotgate.logs import access as access_log
from slotgate.metrics import Metrics
from slotgate.outcome import Outcome
from slotgate.proxy.answer import Answer
from slotgate.proxy.request import Request

#: Refused by the line itself at arrival (full): counted as waits of 0 s under their outcome,
#: so that the wait histogram's counts by outcome add up to every request the line saw.
_TURNED_AWAY = frozenset({Outcome.QUEUE_FULL, Outcome.TENANT_QUEUE_FULL, Outcome.QUEUE_BYTES_FULL})


def account(request: Request, answer: Answer, metrics: Metrics) -> None:
    """Its tokens charged to its tenant's quota, its metrics and its access-log line."""
    if answer.tally is not None:
        answer.tally.settle()
    # `request.route`, without the property's call.
    endpoint = request.endpoint
    route = None if endpoint is None else endpoint.route
    ticket = request.ticket
    now = monotonic()
    hold_s = None
    if ticket is not None and ticket.admitted_at is not None:
        hold_s = now - ticket.admitted_at
    if route is not None:
        # A wait that ended without a slot: an admitted request has its upstream, and its wait
        # was observed when it was admitted.
        waited = ticket is not None and request.upstream is None
        wait_s = ticket.wait_s if waited and ticket is not None else None
        if ticket is None and request.outcome in _TURNED_AWAY:
            wait_s = 0.0
        first = request.first_byte_at
        metrics.ended(
            route, request.outcome, request.tenant.name, wait_s,
            None if first is None else first - request.started, now - request.started,
            hold_s, 0 if ticket is None else ticket.weight, now,
        )  # fmt: skip
    if not access_log.isEnabledFor(logging.INFO):
        return
    access_log.info(
        "%s %s %d %s",
        Client(request.method), Client(request.path), answer.status, request.outcome,
        extra={
            "request_id": request.id,
            "tenant": request.tenant.name,
            "route": route,
            "outcome": request.outcome,
            "status": answer.status,
            "upstream": request.upstream.url if request.upstream is not None else None,
            "upstream_status": request.upstream_status,
            "weight": request.weight,
            "queue_wait_s": round(ticket.wait_s, 4) if ticket is not None else None,
            "slot_hold_s": round(hold_s, 4) if hold_s is not None else None,
            "bytes_out": answer.bytes_out,
            "duration_s": round(now - request.started, 4),
        },
    )  # fmt: skip
