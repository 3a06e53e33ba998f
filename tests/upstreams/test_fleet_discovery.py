"""The fleet's edges: discovery that fails in odd ways, and llama-server's metrics from
several upstreams merged into one valid exposition."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from slotgate.gate.admission import Admission
from slotgate.gate.ticket import Ticket
from slotgate.metrics import Metrics
from slotgate.settings import Settings
from slotgate.upstreams.fleet import Fleet

from tests.support.harness import FakeResponse, FakeUpstreamClient


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def settings_for(url: str) -> Settings:
    return Settings(
        _env_file=None, llama_server_url=url, props_refresh_interval_s=0.05, log_level="warning"
    )


def test_a_host_name_that_cannot_be_encoded_is_refused_at_start_naming_the_setting() -> None:
    # "x..y" has an empty label: encoding it for DNS or the Host header fails (UnicodeError).
    for url in ("http://x..y:9", "http://127.0.0.1:8080,http://" + "a" * 64 + ".test"):
        with pytest.raises(ValidationError, match="host name that cannot be looked up"):
            settings_for(url)


async def test_discovery_goes_on_after_the_resolver_fails_with_something_other_than_oserror() -> (
    None
):
    calls = 0

    async def resolver(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise UnicodeError("label empty or too long")
        return ["127.0.0.1", "127.0.0.2"]

    settings = settings_for("http://llama.fleet.test:9")
    fleet = Fleet(settings, Admission(settings.queue_policy), resolver)
    await fleet.start()
    try:
        await until(lambda: len(fleet.upstreams) == 2)
    finally:
        await fleet.close()


FIRST = b"""# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 10
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
"""
# Another build: another HELP text for one family, and a sample whose label value holds
# what ends a label set ("} "), an escaped quote and a backslash, and a trailing comma.
SECOND = b"""# HELP llamacpp:prompt_tokens_total Prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total{kind="cached",} 20
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing{slot="a} 1 \\"b\\" \\\\"} 2
"""


async def test_llama_servers_metrics_from_several_upstreams_merge_into_one_group_per_family() -> (
    None
):
    settings = settings_for("http://127.0.0.1:9,http://127.0.0.2:9")
    fleet = Fleet(settings, Admission(settings.queue_policy))
    clients = []
    for upstream, text in zip(fleet.upstreams, (FIRST, SECOND), strict=True):
        # Each answers its one /metrics read with `text` (its follower is not started).
        client = FakeUpstreamClient(FakeResponse(200, [], [text]))
        upstream._client = client
        upstream.ready = True
        clients.append(client)
    merged, _ = await fleet.metrics()
    assert [c.requests for c in clients] == [[("GET", "/metrics", b"")]] * 2
    families = list(text_string_to_metric_families(merged.decode()))
    # One family each, declared once and typed, holding both upstreams' samples.
    assert [(f.name, f.type) for f in families] == [
        ("llamacpp:prompt_tokens", "counter"),
        ("llamacpp:requests_processing", "gauge"),
    ]
    first, second = (u.url for u in fleet.upstreams)
    assert [(s.labels, s.value) for s in families[0].samples] == [
        ({"upstream": first}, 10),
        ({"kind": "cached", "upstream": second}, 20),
    ]
    assert [(s.labels, s.value) for s in families[1].samples] == [
        ({"upstream": first}, 1),
        ({"slot": 'a} 1 "b" \\', "upstream": second}, 2),
    ]


Enter = Callable[[int], list[Ticket]]


@contextlib.asynccontextmanager
async def discovered(addresses: list[str]) -> AsyncIterator[tuple[Fleet, Admission, Enter]]:
    """A fleet behind one name, as discovery finds it (no followers: each upstream is made
    ready by hand, as its /props would), with two slots each; and a way to send it requests,
    whose tickets are released at the end, before the fleet closes."""

    async def resolver(host: str, port: int) -> list[str]:
        return list(addresses)

    settings = settings_for("http://llama.fleet.test:9")
    admission = Admission(settings.queue_policy)
    fleet = Fleet(settings, admission, resolver)
    await fleet.discover()
    for upstream in fleet.upstreams:
        upstream.ready = True
        upstream.pool.resize(2)
    tickets: list[Ticket] = []

    def enter(requests: int) -> list[Ticket]:
        entered = [admission.enter() for _ in range(requests)]
        tickets.extend(entered)
        return entered

    try:
        yield fleet, admission, enter
    finally:
        for ticket in tickets:
            ticket.release()
        await fleet.close()


async def test_an_upstream_leaving_with_requests_in_flight_does_not_keep_the_fleet_ready() -> None:
    addresses = ["127.0.0.1", "127.0.0.2"]
    async with discovered(addresses) as (fleet, admission, enter):
        enter(4)
        addresses.clear()  # the name's servers are going away; their requests run on
        await fleet.discover()
        assert admission.capacity is None
        assert not fleet.ready  # nothing can be admitted: /health must not say ready


async def test_an_address_back_while_its_old_self_still_leaves_is_one_series_per_upstream() -> None:
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    async with discovered(addresses) as (fleet, admission, enter):
        enter(6)  # every slot held
        addresses.pop()  # 127.0.0.3 leaves with two requests in flight ...
        await fleet.discover()
        addresses.append("127.0.0.3")  # ... and is back before they end
        await fleet.discover()
        url = "http://127.0.0.3:9"
        next(u for u in fleet.upstreams if u.url == url).pool.resize(2)
        text = Metrics(admission, lambda: fleet.ready).render().decode()
    for family in text_string_to_metric_families(text):
        if family.name.startswith("slotgate_upstream_"):
            labels = [tuple(sorted(s.labels.items())) for s in family.samples]
            assert len(labels) == len(set(labels)), family.name  # Prometheus refuses twins
    gauges = {
        f.name: {s.labels["upstream"]: s.value for s in f.samples}
        for f in text_string_to_metric_families(text)
        if f.name in ("slotgate_upstream_slots_capacity", "slotgate_upstream_slots_active")
    }
    assert gauges["slotgate_upstream_slots_capacity"][url] == 2
    assert gauges["slotgate_upstream_slots_active"][url] == 2  # the leaving one's holders


async def test_an_address_back_before_its_last_requests_ended_takes_none_beyond_its_slots() -> None:
    addresses = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    async with discovered(addresses) as (fleet, admission, enter):
        enter(6)  # every slot held, two on 127.0.0.3
        url = "http://127.0.0.3:9"
        leaving = next(u for u in fleet.upstreams if u.url == url)
        addresses.pop()
        await fleet.discover()
        addresses.append("127.0.0.3")  # the same server is back while its two requests run
        await fleet.discover()
        back = next(u for u in fleet.upstreams if u.url == url)
        back.pool.resize(2)  # its /props: two slots, both still held by those two
        (newcomer,) = enter(1)
        assert not newcomer.admitted
        assert sum(p.active for p in admission.pools if p.key == back.pool.key) == 2
        assert back is leaving  # the one that never stopped running them


async def test_a_name_down_to_one_address_keeps_that_upstream_and_its_holders_counted() -> None:
    addresses = ["127.0.0.1", "127.0.0.2"]
    async with discovered(addresses) as (fleet, _, enter):
        enter(4)  # two on each
        staying = next(u for u in fleet.upstreams if u.url == "http://127.0.0.1:9")
        addresses.pop()  # scaled down to one server, which runs its two requests on
        await fleet.discover()
        assert fleet.upstreams == [staying]
        staying.pool.resize(2)
        (newcomer,) = enter(1)
        assert not newcomer.admitted  # its two slots are still held: nothing more goes there


async def test_a_name_grown_from_one_address_to_several_keeps_its_running_requests_counted() -> (
    None
):
    addresses = ["127.0.0.1"]
    async with discovered(addresses) as (fleet, _, enter):
        (first,) = fleet.upstreams
        assert first.url == "http://llama.fleet.test:9"  # one address: the name, as configured
        enter(2)  # its two slots held
        addresses.append("127.0.0.2")  # scaled out while those two run
        await fleet.discover()
        by_url = {u.url: u for u in fleet.upstreams}
        assert by_url["http://127.0.0.1:9"] is first  # the server that runs them, by its address
        by_url["http://127.0.0.2:9"].pool.resize(2)
        more = enter(3)
        assert [t.admitted for t in more] == [True, True, False]  # none past 127.0.0.1's slots
        assert first.pool.active == 2
