"""slotgate's request metrics against prometheus_client's own types, in-process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from slotgate.admission import Admission, QueuePolicy
from slotgate.metrics import BUCKETS_S, Metrics

ROUTE = "/v1/chat/completions"


def series(text: bytes, prefix: str) -> list[str]:
    return [
        line
        for line in text.decode().splitlines()
        if line.startswith(prefix) and "_created" not in line and f'route="{ROUTE}"' in line
    ]


def test_the_series_are_those_prometheus_clients_own_types_would_expose() -> None:
    metrics = Metrics(Admission(QueuePolicy()), lambda: True)
    reference = CollectorRegistry()
    admitted = Counter("slotgate_requests_admitted", "x", ["route"], registry=reference)
    rejected = Counter("slotgate_requests_rejected", "x", ["route", "reason"], registry=reference)
    wait = Histogram("slotgate_queue_wait_seconds", "x", ["route"], buckets=BUCKETS_S,
                     registry=reference)  # fmt: skip
    hold = Histogram("slotgate_slot_hold_seconds", "x", ["route"], buckets=BUCKETS_S,
                     registry=reference)  # fmt: skip
    # On the bounds, between them and past the last one.
    values = [0.0, 0.005, 0.0051, *BUCKETS_S, 0.3, 599.9, 601.0, 1e6]
    for value in values:
        metrics.admit(ROUTE, value)
        admitted.labels(ROUTE).inc()
        wait.labels(ROUTE).observe(value)
        metrics.hold[ROUTE].observe(value * 2)
        hold.labels(ROUTE).observe(value * 2)
    for reason in ("queue_full", "queue_full", "client_gone"):
        metrics.rejected(ROUTE, reason)
        rejected.labels(ROUTE, reason).inc()
    ours, theirs = metrics.render(), generate_latest(reference)
    for name in ("slotgate_requests_admitted_total", "slotgate_requests_rejected_total",
                 "slotgate_queue_wait_seconds", "slotgate_slot_hold_seconds"):  # fmt: skip
        assert sorted(series(ours, name)) == sorted(series(theirs, name)), name
        assert series(ours, name)
