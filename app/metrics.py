"""Prometheus metrics: counts and histograms per request, pool gauges read at scrape time.

A request updates plain numbers, and they become Prometheus series only when Prometheus
scrapes: prometheus_client's own Counter and Histogram take a lock and walk the buckets on
every update (2.6 us a request for the three each request makes, against 0.4 us here), and
slotgate touches them from one thread, its event loop, which also answers the scrape.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .admission import Admission
from .endpoints import ENDPOINTS

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
        budget = pool.budget_tokens
        yield GaugeMetricFamily(
            "slotgate_kv_budget_tokens",
            "KV-cache tokens shared by the slots that admission counts; 0 when it does not bind",
            value=budget or 0,
        )
        yield GaugeMetricFamily(
            "slotgate_kv_committed_tokens", "KV-cache tokens admitted requests may use",
            value=pool.committed_tokens,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "slotgate_kv_free_tokens", "KV-cache budget left; 0 when it does not bind",
            value=max((budget or 0) - pool.committed_tokens, 0),
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


class _Histogram:
    """Counts per bucket (the last one past every bound) and the sum, as observed."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs in that bound's bucket (le means <=).
        self.counts[bisect.bisect_left(BUCKETS_S, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts, labelled as prometheus_client labels its own."""
        total = 0
        cumulative: list[tuple[str, float]] = []
        for bound, count in zip((*BUCKETS_S, float("inf")), self.counts, strict=True):
            total += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return cumulative


class Metrics(Collector):
    """One registry per app, so that several apps (tests) never share series."""

    def __init__(self, admission: Admission, ready: Callable[[], bool]) -> None:
        self.admitted = dict.fromkeys(ENDPOINTS, 0)
        self.wait = {route: _Histogram() for route in ENDPOINTS}
        self.hold = {route: _Histogram() for route in ENDPOINTS}
        self._rejected: dict[tuple[str, str], int] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(admission, ready))
        self.registry.register(self)

    def admit(self, route: str, wait_s: float) -> None:
        self.admitted[route] += 1
        self.wait[route].observe(wait_s)

    def rejected(self, route: str, reason: str) -> None:
        key = (route, reason)
        self._rejected[key] = self._rejected.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        admitted = CounterMetricFamily(
            "slotgate_requests_admitted", "Requests given slots", labels=["route"]
        )
        for route, count in self.admitted.items():
            admitted.add_metric([route], count)
        yield admitted
        rejected = CounterMetricFamily(
            "slotgate_requests_rejected", "Admitted-route requests that were not served",
            labels=["route", "reason"],
        )  # fmt: skip
        for (route, reason), count in sorted(self._rejected.items()):
            rejected.add_metric([route, reason], count)
        yield rejected
        for name, doc, histograms in (
            ("slotgate_queue_wait_seconds", "Time from arrival to admission", self.wait),
            ("slotgate_slot_hold_seconds", "Time slots were held", self.hold),
        ):
            family = HistogramMetricFamily(name, doc, labels=["route"])
            for route, histogram in histograms.items():
                family.add_metric([route], histogram.buckets(), histogram.sum)
            yield family

    def render(self) -> bytes:
        return generate_latest(self.registry)
