"""Prometheus metrics: counters and histograms per request, pool gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from app.admission import Admission
from app.endpoints import ENDPOINTS

REASONS = (
    "queue_full",
    "queue_timeout",
    "client_gone",
    "upstream_unavailable",
    "upstream_failed",
    "bad_request",
    "unauthorized",
    "internal",
)
#: Queue waits and slot holds span milliseconds (a cached embedding) to minutes (long output).
BUCKETS_S = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _PoolCollector(Collector):
    """Reads the pool when Prometheus scrapes, so requests pay nothing for the gauges."""

    def __init__(self, admission: Admission, ready: Callable[[], bool]) -> None:
        self._admission = admission
        self._ready = ready

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pool = self._admission
        limit = pool.queue_limit
        yield GaugeMetricFamily(
            "slotgate_slots_capacity", "Slots llama-server reports (total_slots); 0 while unknown",
            value=pool.capacity or 0,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "slotgate_slots_active", "Slots held by admitted requests", value=pool.active
        )
        yield GaugeMetricFamily(
            "slotgate_queue_depth", "Requests waiting in line", value=pool.queued
        )
        yield GaugeMetricFamily(
            "slotgate_queue_limit", "Line limit; -1 when unbounded",
            value=-1 if limit is None else limit,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "slotgate_upstream_ready", "1 when llama-server answers and its slots are known",
            value=1 if self._ready() else 0,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "slotgate_slot_hold_estimate_seconds",
            "Moving average of slot hold times, the basis of Retry-After",
            value=pool.hold_estimate_s,
        )


class Metrics:
    """One registry per app, so that several apps (tests) never share series."""

    def __init__(self, admission: Admission, ready: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self._admitted = Counter(
            "slotgate_requests_admitted", "Requests given slots", ["route"],
            registry=self.registry,
        )  # fmt: skip
        self._rejected = Counter(
            "slotgate_requests_rejected", "Admitted-route requests that were not served",
            ["route", "reason"], registry=self.registry,
        )  # fmt: skip
        self._wait = Histogram(
            "slotgate_queue_wait_seconds", "Time from arrival to admission", ["route"],
            buckets=BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self._hold = Histogram(
            "slotgate_slot_hold_seconds", "Time slots were held", ["route"],
            buckets=BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_PoolCollector(admission, ready))
        # Resolve the labelled children once: the hot path then skips the label lookup.
        self.admitted = {r: self._admitted.labels(r) for r in ENDPOINTS}
        self.wait = {r: self._wait.labels(r) for r in ENDPOINTS}
        self.hold = {r: self._hold.labels(r) for r in ENDPOINTS}

    def rejected(self, route: str, reason: str) -> None:
        self._rejected.labels(route, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
