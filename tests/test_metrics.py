"""slotgate's metrics: its request series against prometheus_client's own types, in-process,
and /metrics as operators scrape it."""

from __future__ import annotations

import asyncio
import bisect
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from slotgate import __version__
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.metrics import BUCKETS_S, FAMILIES, REASONS, Metrics, SlotTime, _Histogram
from slotgate.outcome import Outcome
from slotgate.settings import Settings

from tests.conftest import GateFactory, assert_lines, chat
from tests.support.standin import StandIn
from tests.support.tools import tool

ROUTE = "/v1/chat/completions"


def series(text: bytes, prefix: str) -> list[str]:
    return [
        line
        for line in text.decode().splitlines()
        if line.startswith(prefix) and "_created" not in line
    ]


def sample(text: bytes, line_start: str) -> float:
    """The value of the one sample whose line starts with `line_start`."""
    found = [line for line in text.decode().splitlines() if line.startswith(line_start + " ")]
    assert len(found) == 1, (line_start, found)
    return float(found[0].rsplit(" ", 1)[1])


def test_the_series_are_those_prometheus_clients_own_types_would_expose() -> None:
    metrics = Metrics(Admission(QueuePolicy()), lambda: True)
    reference = CollectorRegistry()
    admitted = Counter("slotgate_requests_admitted", "x", ["family"], registry=reference)
    rejected = Counter("slotgate_requests_rejected", "x", ["family", "reason"], registry=reference)
    wait = Histogram("slotgate_queue_wait_seconds", "x", ["family", "outcome"],
                     buckets=BUCKETS_S, registry=reference)  # fmt: skip
    hold = Histogram("slotgate_slot_hold_seconds", "x", ["family"], buckets=BUCKETS_S,
                     registry=reference)  # fmt: skip
    # Every family and reason exists from the start, as .labels() makes them.
    for family in FAMILIES:
        admitted.labels(family)
        wait.labels(family, "admitted")
        hold.labels(family)
        for reason in REASONS:
            rejected.labels(family, reason)
    # On the bounds, between them and past the last one; two routes of one family.
    values = [0.0, 0.05, 0.0501, *BUCKETS_S, 0.3, 599.9, 601.0, 1e6]
    for route in (ROUTE, "/chat/completions"):
        for value in values:
            metrics.admit(route, value)
            admitted.labels("chat").inc()
            wait.labels("chat", "admitted").observe(value)
            metrics.hold[route].observe(value * 2)
            hold.labels("chat").observe(value * 2)
    for route, reason in (
        (ROUTE, "queue_full"), ("/chat/completions", "queue_full"), ("/rerank", "client_gone"),
    ):  # fmt: skip
        metrics.rejected(route, reason)
        rejected.labels("chat" if "chat" in route else "rerank", reason).inc()
    ours, theirs = metrics.render(), generate_latest(reference)
    for name in ("slotgate_requests_admitted_total", "slotgate_requests_rejected_total",
                 "slotgate_queue_wait_seconds", "slotgate_slot_hold_seconds"):  # fmt: skip
        assert sorted(series(ours, name)) == sorted(series(theirs, name)), name
        assert series(ours, name)


def test_every_rejection_reason_reads_zero_before_the_first_rejection() -> None:
    text = Metrics(Admission(QueuePolicy(), capacity=2), lambda: True).render()
    rejected = series(text, "slotgate_requests_rejected_total{")
    assert len(rejected) == len(FAMILIES) * len(REASONS)
    assert all(line.endswith(" 0.0") for line in rejected)
    assert sample(text, 'slotgate_requests_rejected_total{family="chat",reason="queue_full"}') == 0


def test_request_series_are_labelled_by_family_not_by_route() -> None:
    metrics = Metrics(Admission(QueuePolicy(), capacity=2), lambda: True)
    for route in ("/v1/embeddings", "/embedding", "/embeddings"):
        metrics.admit(route, 0.01)
    text = metrics.render()
    assert sample(text, 'slotgate_requests_admitted_total{family="embedding"}') == 3
    assert (
        sample(text, 'slotgate_queue_wait_seconds_count{family="embedding",outcome="admitted"}')
        == 3
    )
    assert "route=" not in text.decode()
    families = {line.split('family="')[1].split('"')[0]
                for line in series(text, "slotgate_slot_hold_seconds_count")}  # fmt: skip
    assert families == {"chat", "completion", "responses", "messages", "embedding", "rerank",
                        "audio"}  # fmt: skip


def test_a_two_second_hold_is_told_apart_from_one_of_one_and_a_half() -> None:
    metrics = Metrics(Admission(QueuePolicy(), capacity=2), lambda: True)
    metrics.hold[ROUTE].observe(1.4)
    metrics.hold[ROUTE].observe(2.0)
    text = metrics.render()
    assert sample(text, 'slotgate_slot_hold_seconds_bucket{family="chat",le="1.5"}') == 1
    assert sample(text, 'slotgate_slot_hold_seconds_bucket{family="chat",le="2.0"}') == 2


@pytest.mark.parametrize(
    ("capacity", "policy", "shown"),
    [
        (None, QueuePolicy(), None),
        (None, QueuePolicy(max_queue=5), None),
        (2, QueuePolicy(max_queue=0), -1.0),
        (2, QueuePolicy(queue_per_slot=3), 6.0),
    ],
)
def test_queue_limit_has_no_sample_while_the_capacity_is_unknown(
    capacity: int | None, policy: QueuePolicy, shown: float | None
) -> None:
    text = Metrics(Admission(policy, capacity=capacity), lambda: True).render()
    samples = [
        line for line in text.decode().splitlines() if line.startswith("slotgate_queue_limit")
    ]
    assert samples == ([] if shown is None else [f"slotgate_queue_limit {shown}"])


async def test_metrics_serve_slotgates_series_and_llama_servers_together_or_apart(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    assert (await client.post(gate.url + ROUTE, json=chat())).status_code == 200
    both = (await client.get(gate.url + "/metrics")).text
    own = await client.get(gate.url + "/metrics", params={"source": "slotgate"})
    theirs = await client.get(gate.url + "/metrics", params={"source": "llama-server"})
    assert own.status_code == theirs.status_code == 200
    assert "slotgate_slots_capacity" in own.text
    assert "llamacpp:" not in own.text
    assert theirs.text.startswith("# HELP llamacpp:requests_processing")
    assert "slotgate_" not in theirs.text
    assert "slotgate_slots_capacity" in both
    assert "llamacpp:requests_processing" in both
    wrong = await client.get(gate.url + "/metrics", params={"source": "both"})
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "source"


@pytest.mark.parametrize("capacity", [None, 2], ids=["unknown", "known"])
def test_slotgates_own_series_pass_promtool(capacity: int | None) -> None:
    metrics = Metrics(Admission(QueuePolicy(), capacity=capacity), lambda: True)
    metrics.admit(ROUTE, 0.3)
    metrics.hold[ROUTE].observe(2.0)
    metrics.rejected(ROUTE, "queue_full")
    promtool = tool("promtool", "prometheus")
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=metrics.render(), capture_output=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_with_keys_request_series_carry_the_tenant_by_name_once_it_has_a_sample() -> None:
    metrics = Metrics(Admission(QueuePolicy(), capacity=2), lambda: True, by_tenant=True)
    metrics.admit(ROUTE, 0.2, "chat")
    metrics.ended(ROUTE, Outcome.SERVED, "chat", None, hold_s=1.4)
    metrics.rejected("/v1/embeddings", "tenant_queue_full", "jobs")
    text = metrics.render()
    assert sample(text, 'slotgate_requests_admitted_total{family="chat",tenant="chat"}') == 1
    wait = 'slotgate_queue_wait_seconds_count{family="chat",outcome="admitted",tenant="chat"}'
    assert sample(text, wait) == 1
    assert sample(text, 'slotgate_slot_hold_seconds_sum{family="chat",tenant="chat"}') == 1.4
    assert (
        sample(
            text,
            'slotgate_requests_rejected_total{family="embedding",reason="tenant_queue_full",'
            'tenant="jobs"}',
        )
        == 1
    )
    assert (
        sample(
            text,
            'slotgate_requests_rejected_total{family="chat",reason="queue_full",tenant="chat"}',
        )
        == 0
    )
    # Only the families a tenant used, and no tenant without a sample.
    assert 'family="rerank"' not in text.decode()
    assert 'tenant=""' not in text.decode()
    for name in ("slotgate_requests_admitted_total{", "slotgate_slot_hold_seconds_count{"):
        assert all("tenant=" in line for line in series(text, name))


def test_the_minute_of_slot_time_counts_each_tenants_part_and_forgets_what_is_older() -> None:
    minute = SlotTime()
    minute.add("flood", 30.0, now=1000.0)
    minute.add("chat", 10.0, now=1015.0)
    assert minute.shares(1020.0) == {"flood": 0.75, "chat": 0.25}
    # A minute on, the flood's bucket has gone: only the chat's remains.
    assert minute.shares(1065.0) == {"chat": 1.0}
    minute.add("chat", 5.0, now=1200.0)  # and old buckets are dropped, not kept
    assert len(minute._buckets) == 1
    assert minute.shares(1300.0) == {}


@given(st.lists(st.sampled_from(BUCKETS_S) | st.floats(0, 1e7) | st.just(0.0), max_size=40))
def test_a_histogram_counts_each_value_under_the_first_bound_not_below_it(
    values: list[float],
) -> None:
    histogram = _Histogram()
    expected = [0] * (len(BUCKETS_S) + 1)
    for value in values:
        histogram.observe(value)
        expected[bisect.bisect_left(BUCKETS_S, value)] += 1
    assert histogram.counts == expected
    assert histogram.sum == sum(values)


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.floats(0.5, 100), st.floats(0, 40)),
        min_size=1,
        max_size=30,
    ),
    st.floats(0, 70),
)
def test_the_minute_of_slot_time_keeps_exactly_the_last_six_ten_second_buckets(
    holds: list[tuple[str, float, float]], later_s: float
) -> None:
    minute = SlotTime()
    now = 1000.0
    added: list[tuple[str, float, float]] = []
    for tenant, slot_seconds, step_s in holds:
        now += step_s
        minute.add(tenant, slot_seconds, now)
        added.append((tenant, slot_seconds, now))
    now += later_s
    kept: dict[str, float] = {}
    for tenant, slot_seconds, at in added:
        if at // 10 > now // 10 - 6:
            kept[tenant] = kept.get(tenant, 0.0) + slot_seconds
    total = sum(kept.values())
    assert minute.shares(now) == pytest.approx({t: v / total for t, v in kept.items()})


async def test_every_queue_wait_is_observed_labelled_by_how_it_ended(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(10_000, queue_timeout_s=0.3)
    pool = gate.service.admission
    holder = asyncio.create_task(client.post(gate.url + ROUTE, json=chat(stream=True)))
    try:
        await gate.until(lambda: pool.active == 1)
        # One waits out QUEUE_TIMEOUT_S, one gives up while waiting.
        timed_out = await client.post(gate.url + ROUTE, json=chat())
        assert timed_out.status_code == 503
        leaver = asyncio.create_task(client.post(gate.url + ROUTE, json=chat()))
        await gate.until(lambda: pool.queued == 1)
        leaver.cancel()
        await asyncio.gather(leaver, return_exceptions=True)
        counts = 'slotgate_queue_wait_seconds_count{family="chat",outcome="client_gone"}'
        async with asyncio.timeout(30):
            while counts not in (await client.get(gate.url + "/metrics")).text:
                await asyncio.sleep(0.02)
    finally:
        standin.hurry()
        await asyncio.gather(holder, return_exceptions=True)
    text = (await client.get(gate.url + "/metrics", params={"source": "slotgate"})).content
    assert sample(text, 'slotgate_queue_wait_seconds_count{family="chat",outcome="admitted"}') == 1
    timeout = 'slotgate_queue_wait_seconds_count{family="chat",outcome="queue_timeout"}'
    assert sample(text, timeout) == 1
    assert sample(text, counts) == 1
    # The one that timed out waited its QUEUE_TIMEOUT_S: it is past the 0.25 s bucket.
    bucket = 'slotgate_queue_wait_seconds_bucket{family="chat",le="0.25",outcome="queue_timeout"}'
    assert sample(text, bucket) == 0
    # An outcome nobody has had yet has no series; admitted is there from the start.
    assert 'outcome="shutdown"' not in text.decode()
    assert 'slotgate_queue_wait_seconds_count{family="rerank",outcome="admitted"} 0.0' in (
        text.decode()
    )


def test_the_tenant_label_names_the_first_tenants_seen_and_the_rest_are_other() -> None:
    pool = Admission(QueuePolicy(), capacity=2)
    metrics = Metrics(pool, lambda: True, by_tenant=True, tenants=2)
    for tenant in ("a", "b", "c", "d", "a"):
        metrics.admit(ROUTE, 0.1, tenant)
        metrics.ended(ROUTE, Outcome.SERVED, tenant, None, hold_s=1.0)
    metrics.rejected(ROUTE, "queue_full", "e")
    text = metrics.render()
    assert sample(text, 'slotgate_requests_admitted_total{family="chat",tenant="a"}') == 2
    assert sample(text, 'slotgate_requests_admitted_total{family="chat",tenant="b"}') == 1
    assert sample(text, 'slotgate_requests_admitted_total{family="chat",tenant="other"}') == 2
    assert sample(text, 'slotgate_slot_hold_seconds_count{family="chat",tenant="other"}') == 2
    rejected = 'slotgate_requests_rejected_total{family="chat",reason="queue_full",tenant="other"}'
    assert sample(text, rejected) == 1
    assert 'tenant="c"' not in text.decode()
    # /admission's minute of slot time still names every tenant.
    assert set(metrics.minute.shares(time.monotonic())) == {"a", "b", "c", "d"}


def test_with_no_tenants_in_the_metrics_the_series_carry_no_tenant_label() -> None:
    pool = Admission(QueuePolicy(), capacity=2)
    metrics = Metrics(pool, lambda: True, by_tenant=True, tenants=0)
    metrics.admit(ROUTE, 0.1, "a")
    metrics.admit(ROUTE, 0.1, "b")
    metrics.rejected(ROUTE, "unauthorized", "")
    text = metrics.render()
    assert "tenant=" not in text.decode()
    assert sample(text, 'slotgate_requests_admitted_total{family="chat"}') == 2
    assert (
        sample(text, 'slotgate_requests_rejected_total{family="chat",reason="unauthorized"}') == 1
    )


async def test_metrics_tenants_caps_the_tenant_label_of_a_gate_with_keys(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    keys = [f"key-{n}" for n in range(3)]
    gate = await start_gate(api_keys=",".join(keys), metrics_tenants=1)
    for key in keys:
        answer = await client.post(
            gate.url + ROUTE, json=chat(), headers={"authorization": f"Bearer {key}"}
        )
        assert answer.status_code == 200
    text = (
        await client.get(gate.url + "/metrics", headers={"authorization": f"Bearer {keys[0]}"})
    ).content
    tenants = {
        line.split('tenant="')[1].split('"')[0]
        for line in series(text, "slotgate_requests_admitted_total{")
    }
    assert len(tenants) == 2
    assert "other" in tenants
    assert sample(text, 'slotgate_requests_admitted_total{family="chat",tenant="other"}') == 2


def test_metrics_tenants_defaults_to_ten() -> None:
    assert Settings(_env_file=None).metrics_tenants == 10


def test_metrics_carry_the_process_series_and_the_build_info() -> None:
    text = Metrics(Admission(QueuePolicy(), capacity=2), lambda: True).render().decode()
    build = [line for line in text.splitlines() if line.startswith("slotgate_build_info{")]
    python = ".".join(str(part) for part in sys.version_info[:3])
    assert build == [f'slotgate_build_info{{python="{python}",version="{__version__}"}} 1.0']
    if sys.platform.startswith("linux"):  # prometheus_client reads /proc
        assert sample(text.encode(), "process_resident_memory_bytes") > 0
        assert "process_cpu_seconds_total " in text
        assert "process_open_fds " in text


async def test_time_to_first_byte_and_duration_are_observed_for_answered_requests_only(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(3, max_queue=0)
    standin.hold_s = 0.2  # before the first token
    for stream in (True, False):
        assert (await client.post(gate.url + ROUTE, json=chat(stream=stream))).status_code == 200
    refused = await client.post(
        gate.url + ROUTE, content=b"{", headers={"content-type": "application/json"}
    )
    assert refused.status_code == 400
    text = (await client.get(gate.url + "/metrics", params={"source": "slotgate"})).content
    first = 'slotgate_time_to_first_byte_seconds_{}{{family="chat"}}'
    whole = 'slotgate_request_duration_seconds_{}{{family="chat"}}'
    assert sample(text, first.format("count")) == 2
    assert sample(text, whole.format("count")) == 2
    # Nothing can come before llama-server's first token, nor end before it.
    assert sample(text, first.format("sum")) >= 2 * standin.hold_s
    assert sample(text, whole.format("sum")) >= sample(text, first.format("sum"))
    assert sample(text, 'slotgate_time_to_first_byte_seconds_bucket{family="chat",le="0.025"}') == 0


def test_each_upstream_shows_its_kv_budget_and_what_is_committed_of_it() -> None:
    admission = Admission(QueuePolicy(), epsilon=1.0)
    pool = admission.add_pool("http://10.0.0.1:8080")
    pool.resize(2)
    pool.resize_budget(4096)
    ticket = admission.enter(cost=1000)
    text = Metrics(admission, lambda: True).render()
    assert_lines(
        text.decode(),
        'slotgate_upstream_kv_budget_tokens{upstream="http://10.0.0.1:8080"} 4096.0',
        'slotgate_upstream_kv_committed_tokens{upstream="http://10.0.0.1:8080"} 1000.0',
        'slotgate_upstream_draining{upstream="http://10.0.0.1:8080"} 0.0',
        "slotgate_admission_paused 0.0",
    )
    ticket.release()


async def test_a_request_the_full_line_turns_away_counts_as_a_wait_of_nothing(
    one_slot_held: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(max_queue=1)
    waiter = asyncio.create_task(client.post(gate.url + ROUTE, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert (await client.post(gate.url + ROUTE, json=chat())).status_code == 429
    text = (await client.get(gate.url + "/metrics", params={"source": "slotgate"})).content
    full = 'slotgate_queue_wait_seconds_{}{{family="chat",outcome="queue_full"}}'
    assert sample(text, full.format("count")) == 1
    assert sample(text, full.format("sum")) == 0
    # A bad request never reached the line: counted, not a wait.
    refused = await client.post(
        gate.url + ROUTE, content=b"{", headers={"content-type": "application/json"}
    )
    assert refused.status_code == 400
    text = (await client.get(gate.url + "/metrics", params={"source": "slotgate"})).content
    assert b'outcome="bad_request"' not in text
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


async def test_a_client_gone_before_its_first_byte_counts_as_a_wait_not_as_latency(
    one_slot_held: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held()
    leaving = asyncio.create_task(client.post(gate.url + ROUTE, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await gate.until(lambda: b'outcome="client_gone"' in gate.service.metrics.render())
    text = (await client.get(gate.url + "/metrics", params={"source": "slotgate"})).content
    gone = 'slotgate_queue_wait_seconds_count{family="chat",outcome="client_gone"}'
    assert sample(text, gone) == 1
    # The slot holder's stream still runs: no request has ended served yet.
    assert sample(text, 'slotgate_time_to_first_byte_seconds_count{family="chat"}') == 0
    assert sample(text, 'slotgate_request_duration_seconds_count{family="chat"}') == 0
