"""Prometheus metrics: counts and histograms per request, pool gauges read at scrape time.

A request updates plain numbers, and they become Prometheus series only when Prometheus
scrapes: prometheus_client's own Counter and Histogram take a lock and walk the buckets on
every update (2.6 us a request for the three each request makes, against 0.4 us here), and
slotgate touches them from one thread, its event loop, which also answers the scrape.
"""

from __future__ import annotations

import platform
from collections import deque
from collections.abc import Callable, Iterator
from time import monotonic
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from slotgate import __version__
from slotgate.gate.tenants import EVERYONE
from slotgate.intake.endpoints import ENDPOINTS, Kind
from slotgate.outcome import REASONS as REASONS  # re-exported: the labels metrics pins
from slotgate.outcome import Outcome

if TYPE_CHECKING:
    from slotgate.gate.admission import Admission
    from slotgate.gate.entry import Gate
    from slotgate.gate.models import Models

#: The operator controls (app/controls.py): the `action` label of slotgate_operator_actions.
ACTIONS = ("drain", "restore", "pause", "resume", "cancel")
#: What a replica sharing the line through Redis does now (app/replicas/replica.py).
REPLICATION_MODES = ("shared", "degraded", "rejecting")

#: The `outcome` of a wait that ended in a slot; other waits carry the reason they ended (one of
#: REASONS, the `reason` labels of slotgate_requests_rejected).
ADMITTED = Outcome.ADMITTED
SERVED = Outcome.SERVED
#: The tenant label of the tenants past METRICS_TENANTS.
OTHER = "other"
#: Request series are labelled by what operators group by, the kind of work (chat, completion,
#: responses, messages, embedding, rerank, audio), not by the 17 paths that lead to it.
FAMILIES = tuple(kind.value for kind in Kind)
#: Queue waits and slot holds of LLM work: sub-second (embeddings, short answers, no wait) to
#: minutes (long outputs, deep lines). About 1.5x apart from 1 s to a minute, where most holds
#: and waits fall, so a quantile read from them is within a quarter of the truth there. (Floats
#: all: an observation compared with an int bound takes a slower path, four times a request.)
BUCKETS_S = (
    0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip
#: Time to first byte: a prompt's processing (tens of milliseconds for a short one on a GPU, to
#: tens of seconds for a long one on a CPU) plus any wait in the line. Finer below a second,
#: where an interactive SLO sits (a p95 of 0.5 s or 1 s is told from 0.75 s).
FIRST_BYTE_BUCKETS_S = (
    0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 60.0, 120.0,
)  # fmt: skip


# SlotTime's buckets: module constants, as a class attribute read through `self` costs
# Python 3.11 a generic lookup on every hold that ends.
_SLOT_BUCKET_S = 10.0
_SLOT_BUCKETS = 6


class SlotTime:
    """Slot-seconds of the holds that ended, per tenant, over the last minute: six buckets of
    ten seconds, the oldest dropped as time moves on (so 50 to 60 s of them at any moment)."""

    def __init__(self) -> None:
        self._buckets: deque[tuple[int, dict[str, float]]] = deque()
        # The newest bucket's ten seconds, as times (not yet one: -1 to -1) and its totals:
        # every request ends here, and nearly always within them.
        self._since = -1.0
        self._until = -1.0
        self._totals: dict[str, float] = {}

    def add(self, tenant: str, slot_seconds: float, now: float) -> None:
        if not self._since <= now < self._until:
            index = int(now // _SLOT_BUCKET_S)
            buckets = self._buckets
            if not buckets or buckets[-1][0] != index:
                buckets.append((index, {}))
                while buckets[0][0] <= index - _SLOT_BUCKETS:
                    buckets.popleft()
            self._since = index * _SLOT_BUCKET_S
            self._until = self._since + _SLOT_BUCKET_S
            self._totals = buckets[-1][1]
        totals = self._totals
        totals[tenant] = totals.get(tenant, 0.0) + slot_seconds

    def shares(self, now: float) -> dict[str, float]:
        """Each tenant's part of the slot-seconds held over the last minute (none: empty)."""
        oldest = int(now // _SLOT_BUCKET_S) - _SLOT_BUCKETS
        sums: dict[str, float] = {}
        for index, totals in self._buckets:
            if index > oldest:
                for tenant, value in totals.items():
                    sums[tenant] = sums.get(tenant, 0.0) + value
        total = sum(sums.values())
        return {tenant: value / total for tenant, value in sums.items()} if total else {}


class _PoolCollector(Collector):
    """Reads the pool when Prometheus scrapes, so requests pay nothing for the gauges."""

    def __init__(self, admission: Admission, ready: Callable[[], bool]) -> None:
        self._admission = admission
        self._ready = ready

    def collect(self) -> Iterator[Metric]:
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
            "slotgate_queue_depth", "Requests waiting in the queue", value=pool.queued
        )
        # No sample while the capacity is unknown: the limit depends on it (QUEUE_PER_SLOT),
        # and nobody queues meanwhile (requests are refused as not ready).
        queue_limit = GaugeMetricFamily(
            "slotgate_queue_limit", "Line limit; -1 when unbounded, no sample while unknown"
        )
        if pool.capacity is not None:
            queue_limit.add_metric([], -1 if limit is None else limit)
        yield queue_limit
        budget = pool.snapshot().budget_tokens
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
        # One series per upstream, labelled by its URL: its share of the fleet's pool.
        capacity = GaugeMetricFamily(
            "slotgate_upstream_slots_capacity", "An upstream's slots; 0 while unknown",
            labels=["upstream"],
        )  # fmt: skip
        active = GaugeMetricFamily(
            "slotgate_upstream_slots_active", "An upstream's slots held", labels=["upstream"]
        )
        available = GaugeMetricFamily(
            "slotgate_upstream_available", "1 when the upstream is ready and routed to",
            labels=["upstream"],
        )  # fmt: skip
        draining = GaugeMetricFamily(
            "slotgate_upstream_draining",
            "1 while an operator has drained the upstream (POST /admin/upstreams/{name}/drain)",
            labels=["upstream"],
        )
        kv_budget = GaugeMetricFamily(
            "slotgate_upstream_kv_budget_tokens",
            "An upstream's KV-cache tokens its slots share; 0 when no budget binds",
            labels=["upstream"],
        )
        kv_committed = GaugeMetricFamily(
            "slotgate_upstream_kv_committed_tokens",
            "KV-cache tokens the requests running on an upstream may use",
            labels=["upstream"],
        )
        routed = CounterMetricFamily(
            "slotgate_upstream_routed",
            "Requests given slots on an upstream, by why it was chosen: its affinity key's first "
            "choice, load, or a retry after another upstream did not take it",
            labels=["upstream", "reason"],
        )
        for one in pool.pools:
            capacity.add_metric([one.key], one.capacity or 0)
            active.add_metric([one.key], one.active)
            available.add_metric([one.key], 0 if one.capacity is None else 1)
            draining.add_metric([one.key], 1 if one.draining else 0)
            kv_budget.add_metric([one.key], one.budget or 0)
            kv_committed.add_metric([one.key], one.committed)
            for reason, count in one.routed.items():
                routed.add_metric([one.key, reason], count)
        yield capacity
        yield active
        yield available
        yield draining
        yield kv_budget
        yield kv_committed
        yield routed
        yield kv_cache_usage(pool)
        yield GaugeMetricFamily(
            "slotgate_admission_paused",
            "1 while an operator has paused admission (POST /admin/pause)",
            value=1 if pool.paused else 0,
        )
        yield GaugeMetricFamily(
            "slotgate_slot_hold_estimate_seconds",
            "Moving average of slot hold times (until one is seen: the mean hold expected "
            "from max_tokens and llama-server's speed), the basis of Retry-After",
            value=pool.hold_estimate_s,
        )


# -- the Inference Gateway's endpoint picker ----------------------------------------------------
#: The entry of the picker's `core-metrics-extractor` `engineConfigs` that reads a pod with a
#: slotgate sidecar (labelled `llm-d.ai/engine-type: slotgate`): its model-server protocol's
#: three gauges, unlabelled, one per pod. Queued is the line; running is the slots held, as
#: each slot is one sequence llama.cpp decodes; KV use is a fraction from 0 to 1, as vLLM's
#: `vllm:kv_cache_usage_perc` is (the picker scores a pod by 1 minus it). docs/kubernetes.md.
ENGINE_CONFIG = {
    "name": "slotgate",
    "queuedRequestsSpec": "slotgate_queue_depth",
    "runningRequestsSpec": "slotgate_slots_active",
    "kvUsageSpec": "slotgate_kv_cache_usage_ratio",
}


def kv_cache_usage(pool: Admission) -> GaugeMetricFamily:
    """The part of the KV cache spoken for: tokens committed over the budget where one binds;
    without one each slot owns a fixed share of the cache (llama-server --parallel), so the
    part of the slots held; 0 while the slots are unknown."""
    snapshot = pool.snapshot()
    if snapshot.budget_tokens:
        used = snapshot.committed_tokens / snapshot.budget_tokens
    else:
        used = snapshot.active / snapshot.capacity if snapshot.capacity else 0.0
    return GaugeMetricFamily(
        "slotgate_kv_cache_usage_ratio",
        "KV cache spoken for, 0 to 1: committed tokens over KV_BUDGET_TOKENS where a budget "
        "binds, else slots held over slots (each slot owns its share of the cache)",
        value=min(used, 1.0),
    )


class _ModelsCollector(Collector):
    """Each model's line behind llama-server routers, labelled by its id (at most MAX_MODELS),
    read at scrape time; nothing while no upstream is a router."""

    def __init__(self, models: Models) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        if not self._models.routed:
            return
        families = {
            name: GaugeMetricFamily(name, text, labels=["model"])
            for name, text in (
                ("slotgate_model_slots_capacity", "A model's slots; 0 while unloaded"),
                ("slotgate_model_slots_active", "A model's slots held by admitted requests"),
                ("slotgate_model_queue_depth", "Requests waiting in a model's line"),
                ("slotgate_model_loaded", "1 while a router runs the model with known slots"),
                ("slotgate_model_hold_estimate_seconds", "A model's moving average of holds"),
            )
        }  # fmt: skip
        for lane in self._models:
            admission = lane.admission
            values = (
                admission.capacity or 0, admission.active, admission.queued,
                0 if admission.capacity is None else 1, admission.hold_estimate_s,
            )  # fmt: skip
            for family, value in zip(families.values(), values, strict=True):
                family.add_metric([lane.model], value)
        yield from families.values()


class _ReplicaCollector(Collector):
    """The fleet's line as Redis last told it, and this replica's part, read at scrape time
    (nothing where the gate keeps its line alone: its view names no fleet)."""

    def __init__(self, gate: Gate) -> None:
        self._gate = gate

    def collect(self) -> Iterator[Metric]:
        view = self._gate.view()
        if "fleet" not in view:
            return
        mode = GaugeMetricFamily(
            "slotgate_replication_mode",
            "1 for what this replica does now: shared (one line through Redis), degraded (Redis "
            "away: gating alone on its share) or rejecting (Redis away, REDIS_FAILURE_MODE=reject)",
            labels=["mode"],
        )
        for name in REPLICATION_MODES:
            mode.add_metric([name], 1 if view["mode"] == name else 0)
        yield mode
        yield CounterMetricFamily(
            "slotgate_replication_fallbacks",
            "Times this replica found Redis away and fell back (REDIS_FAILURE_MODE)",
            value=view["fallbacks"],
        )
        fleet = view["fleet"]
        for name, help_text in (
            ("capacity", "Slots of the whole fleet, as Redis last told this replica"),
            ("active", "Slots held fleet-wide, as Redis last told this replica"),
            ("queued", "Requests waiting in the fleet's shared line, as Redis last told"),
            ("replicas", "Replicas sharing the line, as Redis last told this replica"),
        ):
            yield GaugeMetricFamily(f"slotgate_fleet_{name}", help_text, value=fleet[name])
        yield GaugeMetricFamily(
            "slotgate_replica_queue_depth",
            "This replica's requests waiting in the fleet's shared line",
            value=view["this_replica"]["queued"],
        )


class _Histogram:
    """Counts per bucket (the last one past every bound) and the sum, as observed: one
    bisection and two additions into a list made at the start."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left's search, written out: a value equal to a bound belongs in that bound's
        # bucket (le means <=). Compiled, this loop over unboxed floats costs a fifth of a
        # call to bisect, which compares Python floats; every request observes four.
        bounds = self.bounds
        low = 0
        high = len(bounds)
        while low < high:
            middle = (low + high) >> 1
            if bounds[middle] < value:
                low = middle + 1
            else:
                high = middle
        self.counts[low] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts, labelled as prometheus_client labels its own."""
        total = 0
        cumulative: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return cumulative


class _Series:
    """One tenant's request series (everyone's, without keys); routes of a family share the
    family's histograms."""

    __slots__ = (
        "admitted", "duration", "ended", "first_byte", "histograms", "hold", "rejected", "wait",
    )  # fmt: skip

    def __init__(self, family_of: dict[str, str]) -> None:
        self.admitted = dict.fromkeys(ENDPOINTS, 0)
        waits = {family: _Histogram() for family in FAMILIES}
        holds = {family: _Histogram() for family in FAMILIES}
        firsts = {family: _Histogram(FIRST_BYTE_BUCKETS_S) for family in FAMILIES}
        durations = {family: _Histogram() for family in FAMILIES}
        self.wait = {route: waits[family] for route, family in family_of.items()}
        self.hold = {route: holds[family] for route, family in family_of.items()}
        self.first_byte = {route: firsts[family] for route, family in family_of.items()}
        self.duration = {route: durations[family] for route, family in family_of.items()}
        self.histograms = {
            "wait": waits, "hold": holds, "first_byte": firsts, "duration": durations,
        }  # fmt: skip
        self.rejected: dict[tuple[str, str], int] = {}
        #: Waits that ended without a slot, by (family, outcome): made at the first of each,
        #: so that outcomes nobody has had add no series.
        self.ended: dict[tuple[str, str], _Histogram] = {}

    def families(self, family_of: dict[str, str]) -> set[str]:
        """The families it has any sample of."""
        used = {family_of[route] for route, count in self.admitted.items() if count}
        used.update(family_of[route] for route, _ in self.rejected)
        for histograms in self.histograms.values():
            used.update(family for family, h in histograms.items() if any(h.counts))
        used.update(family for family, _ in self.ended)
        return used


class Metrics(Collector):
    """One registry per app, so that several apps (tests) never share series.

    `admit`, `waited`, `rejected`, `ended` (and `wait` and `hold`, everyone's) take a request's
    route (its path); every route of a family shares the family's histograms, so the lookup
    costs a request nothing more. With `by_tenant` (slotgate has keys) each series carries a
    `tenant` label, the tenant's name ("" for requests refused before a key was known), and a
    tenant's series appear once it has a sample in the family. The first `tenants` tenants
    seen keep their names; later ones share the label `other` (0: no tenant label at all).
    """

    def __init__(
        self,
        admission: Admission,
        ready: Callable[[], bool],
        *,
        by_tenant: bool = False,
        tenants: int = 10,
        gate: Gate | None = None,
        models: Models | None = None,
    ) -> None:
        self._family = {route: endpoint.kind.value for route, endpoint in ENDPOINTS.items()}
        self._by_tenant = by_tenant and tenants > 0
        self._tenants = tenants
        #: Slot-seconds each tenant held over about the last minute (`/admission`).
        self.minute = SlotTime()
        #: By label value; `_of_tenant` caches each tenant name's series, so that a request
        #: pays one dict lookup for its label, whatever the cap decided.
        self._series: dict[str, _Series] = {}
        self._of_tenant: dict[str, _Series] = {}
        everyone = self._of(EVERYONE.name)
        self.admitted = everyone.admitted
        self.wait = everyone.wait
        self.hold = everyone.hold
        self._rejected = everyone.rejected
        #: Operator actions taken, by action (app/controls.py).
        self.actions = dict.fromkeys(ACTIONS, 0)
        self._build = GaugeMetricFamily(
            "slotgate_build_info", "slotgate's version and Python's; always 1",
            labels=["version", "python"],
        )  # fmt: skip
        self._build.add_metric([__version__, platform.python_version()], 1)
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(admission, ready))
        if gate is not None:
            self.registry.register(_ReplicaCollector(gate))
        if models is not None:
            self.registry.register(_ModelsCollector(models))
        self.registry.register(self)
        # process_* (CPU, memory, open files, start time), read from /proc at scrape time.
        ProcessCollector(registry=self.registry)

    def _of(self, tenant: str) -> _Series:
        named = sum(name not in (EVERYONE.name, OTHER) for name in self._series)
        if not self._by_tenant:
            label = EVERYONE.name
        elif tenant == EVERYONE.name or tenant in self._series or named < self._tenants:
            label = tenant
        else:
            label = OTHER
        series = self._series.get(label)
        if series is None:
            series = self._series[label] = _Series(self._family)
        self._of_tenant[tenant] = series
        return series

    def admit(self, route: str, wait_s: float, tenant: str = EVERYONE.name) -> None:
        series = self._of_tenant.get(tenant) or self._of(tenant)
        series.admitted[route] += 1
        series.wait[route].observe(wait_s)

    def waited(self, route: str, wait_s: float, outcome: str, tenant: str = EVERYONE.name) -> None:
        """A wait that ended without a slot: timed out, the client gone, refused meanwhile."""
        ended = (self._of_tenant.get(tenant) or self._of(tenant)).ended
        key = (self._family[route], outcome)
        histogram = ended.get(key)
        if histogram is None:
            histogram = ended[key] = _Histogram()
        histogram.observe(wait_s)

    def ended(
        self,
        route: str,
        outcome: Outcome,
        tenant: str,
        wait_s: float | None,
        first_byte_s: float | None = None,
        duration_s: float | None = None,
        hold_s: float | None = None,
        slots: int = 1,
        now: float | None = None,
    ) -> None:
        """A request on a generation route is over. Served (llama-server's answer relayed, an
        error of its own included), it counts in the first-byte and duration histograms (given
        those); else as rejected under its outcome's reason, and, given `wait_s`, as a wait
        that ended without a slot. Given `hold_s`, it held `slots` slots that long, until
        `now` (time.monotonic(); read here if not given), whatever its outcome. One call for
        all of it, the tenant's series looked up once: every request ends here."""
        series = self._of_tenant.get(tenant) or self._of(tenant)
        if hold_s is not None:
            series.hold[route].observe(hold_s)
            self.minute.add(tenant, hold_s * slots, monotonic() if now is None else now)
        # Served, nearly always: known without the property's call.
        reason = None if outcome is SERVED else outcome.reason
        if reason is None:
            if duration_s is not None:
                if first_byte_s is not None:
                    series.first_byte[route].observe(first_byte_s)
                series.duration[route].observe(duration_s)
            return
        self.rejected(route, reason, tenant)
        if wait_s is not None:
            self.waited(route, wait_s, reason, tenant)

    def operator(self, action: str) -> None:
        self.actions[action] += 1

    def rejected(self, route: str, reason: str, tenant: str = EVERYONE.name) -> None:
        rejected = (self._of_tenant.get(tenant) or self._of(tenant)).rejected
        key = (route, reason)
        rejected[key] = rejected.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        by_tenant = self._by_tenant
        labels = ["family", "tenant"] if by_tenant else ["family"]
        admitted = CounterMetricFamily(
            "slotgate_requests_admitted", "Requests given slots", labels=labels
        )
        rejected = CounterMetricFamily(
            "slotgate_requests_rejected", "Admitted-route requests that were not served",
            labels=[*labels, "reason"],
        )  # fmt: skip
        wait = HistogramMetricFamily(
            "slotgate_queue_wait_seconds",
            "Time from arrival to the end of the wait: admitted, or the reason it ended without "
            "a slot (queue_timeout, client_gone, ...)",
            labels=[*labels, "outcome"],
        )
        hold = HistogramMetricFamily(
            "slotgate_slot_hold_seconds", "Time slots were held", labels=labels
        )
        first_byte = HistogramMetricFamily(
            "slotgate_time_to_first_byte_seconds",
            "From a request's arrival (its wait included) to the first byte of llama-server's "
            "answer body: for a stream, its first event",
            labels=labels,
        )
        duration = HistogramMetricFamily(
            "slotgate_request_duration_seconds",
            "From a request's arrival to the end of the answer llama-server gave it (end to end)",
            labels=labels,
        )
        for tenant, series in self._series.items():
            if by_tenant:
                families = series.families(self._family)
                if not families:
                    continue
                shown = [family for family in FAMILIES if family in families]
            else:
                shown = list(FAMILIES)
            # With keys, EVERYONE is a request refused before its key was known: no tenant.
            named = [tenant if tenant != EVERYONE.name else ""] if by_tenant else []
            by_family = dict.fromkeys(shown, 0)
            for route, count in series.admitted.items():
                if self._family[route] in by_family:
                    by_family[self._family[route]] += count
            for family, count in by_family.items():
                admitted.add_metric([family, *named], count)
            # Every reason from the start, at 0: rate() then sees the first rejection, and an
            # alert on queue_full reads 0 rather than nothing.
            counts = {(family, reason): 0 for family in shown for reason in REASONS}
            for (route, reason), count in series.rejected.items():
                key = (self._family[route], reason)
                counts[key] = counts.get(key, 0) + count
            for (family, reason), count in counts.items():
                rejected.add_metric([family, *named, reason], count)
            for family in shown:
                waits = series.histograms["wait"][family]
                wait.add_metric([family, *named, ADMITTED], waits.buckets(), waits.sum)
                for outcome in sorted(o for f, o in series.ended if f == family):
                    ended = series.ended[family, outcome]
                    wait.add_metric([family, *named, outcome], ended.buckets(), ended.sum)
                holds = series.histograms["hold"][family]
                hold.add_metric([family, *named], holds.buckets(), holds.sum)
                firsts = series.histograms["first_byte"][family]
                first_byte.add_metric([family, *named], firsts.buckets(), firsts.sum)
                durations = series.histograms["duration"][family]
                duration.add_metric([family, *named], durations.buckets(), durations.sum)
        yield admitted
        yield rejected
        yield wait
        yield hold
        yield first_byte
        yield duration
        actions = CounterMetricFamily(
            "slotgate_operator_actions",
            "Operator controls used (drain, restore, pause, resume, cancel)",
            labels=["action"],
        )
        for action, count in self.actions.items():
            actions.add_metric([action], count)
        yield actions
        yield self._build

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> Totals:
        """Everyone's counts since start, summed over tenants and families: read when the
        status page's figures are asked for, never per request."""
        admitted = 0
        rejected: dict[str, int] = {}
        wait = [0] * (len(BUCKETS_S) + 1)
        hold = [0] * (len(BUCKETS_S) + 1)
        for series in self._series.values():
            admitted += sum(series.admitted.values())
            for (_, reason), count in series.rejected.items():
                rejected[reason] = rejected.get(reason, 0) + count
            for histograms, into in (
                (series.histograms["wait"], wait),
                (series.histograms["hold"], hold),
            ):
                for histogram in histograms.values():
                    for index, count in enumerate(histogram.counts):
                        into[index] += count
        return Totals(admitted, rejected, wait, hold)


class Totals(NamedTuple):
    """`Metrics.totals`: requests admitted, not served by reason, and the bucket counts (as
    `BUCKETS_S`, then past the last) of every admitted wait and every slot hold."""

    admitted: int
    rejected: dict[str, int]
    wait: list[int]
    hold: list[int]
