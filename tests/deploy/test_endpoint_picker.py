"""slotgate's gauges read as the Inference Gateway's endpoint picker reads a model server: its
`core-metrics-extractor` takes, per pod, the family its engine's spec names from the scraped
/metrics text and reads its first matching sample (llm-d/llm-d-router,
pkg/epp/framework/plugins/datalayer/extractor/metrics/spec.go and extractor.go)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.metrics import ENGINE_CONFIG, Metrics

from tests.conftest import GateFactory, chat
from tests.support.standin import StandIn

#: The model-server protocol's three gauges and the engineConfigs keys that name them
#: (gateway-api-inference-extension, docs/proposals/003-model-server-protocol).
PROTOCOL = {
    "TotalQueuedRequests": "queuedRequestsSpec",
    "TotalRunningRequests": "runningRequestsSpec",
    "KVCacheUtilization": "kvUsageSpec",
}
#: A spec: a metric name and optional label matchers, `name{label=value,...}`.
_SPEC = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")


@dataclass(frozen=True)
class Reading:
    """What the picker keeps of a pod: WaitingQueueSize and RunningRequestsSize as ints,
    KVCacheUsagePercent as a float (a fraction: its scorer uses 1 minus it)."""

    queued: int
    running: int
    kv_usage: float


def scrape(text: str, engine: dict[str, str]) -> Reading:
    """The picker's reading of one scrape, failing where the picker would find nothing."""
    families = {family.name: family for family in text_string_to_metric_families(text)}
    values: dict[str, float] = {}
    for metric, key in PROTOCOL.items():
        matched = _SPEC.match(engine[key])
        assert matched, engine[key]
        name, labels = (
            matched[1],
            dict(pair.split("=", 1) for pair in (matched[2] or "").split(",") if pair),
        )
        family = families.get(name)
        assert family is not None, f"{metric}: no family {name}"
        # The protocol's metrics are gauges; the picker reads a counter too, but its value
        # would only grow.
        assert family.type == "gauge", (name, family.type)
        samples = [
            s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())
        ]
        # One series per pod: with several the picker takes the first, whichever it is.
        assert len(samples) == 1, (name, samples)
        values[metric] = samples[0].value
    for metric in ("TotalQueuedRequests", "TotalRunningRequests"):
        assert values[metric] >= 0
        assert values[metric] == int(values[metric]), (metric, values[metric])
    assert 0.0 <= values["KVCacheUtilization"] <= 1.0
    return Reading(
        int(values["TotalQueuedRequests"]),
        int(values["TotalRunningRequests"]),
        values["KVCacheUtilization"],
    )


def read(admission: Admission) -> Reading:
    return scrape(Metrics(admission, lambda: True).render().decode(), ENGINE_CONFIG)


def test_the_engine_config_names_one_spec_for_each_gauge_of_the_protocol() -> None:
    assert set(ENGINE_CONFIG) == {"name", *PROTOCOL.values()}
    assert ENGINE_CONFIG["name"] == "slotgate"


def test_an_idle_pod_reads_nothing_queued_nothing_running_and_an_empty_cache() -> None:
    assert read(Admission(QueuePolicy(), capacity=4)) == Reading(0, 0, 0.0)


def test_a_pod_whose_slots_are_unknown_reads_an_empty_cache() -> None:
    assert read(Admission(QueuePolicy())) == Reading(0, 0, 0.0)


async def test_without_a_budget_the_cache_in_use_is_the_part_of_the_slots_held() -> None:
    admission = Admission(QueuePolicy(), capacity=4)
    tickets = [admission.enter() for _ in range(3)]
    assert read(admission) == Reading(0, 3, 0.75)
    tickets.append(admission.enter())
    waiting = [admission.enter(), admission.enter()]
    assert read(admission) == Reading(2, 4, 1.0)
    for ticket in [*tickets, *waiting]:
        ticket.release()
    await asyncio.sleep(0)


async def test_with_a_budget_the_cache_in_use_is_the_tokens_committed_over_the_budget() -> None:
    admission = Admission(QueuePolicy(), capacity=4)
    admission.resize_budget(1000)
    first = admission.enter(1, 250)
    assert read(admission) == Reading(0, 1, 0.25)
    second = admission.enter(1, 700)
    assert read(admission) == Reading(0, 2, 0.95)
    # Slots free, tokens not: it waits, and the cache reads as nearly full, not half empty.
    third = admission.enter(1, 400)
    assert read(admission) == Reading(1, 2, 0.95)
    for ticket in (first, second, third):
        ticket.release()
    await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("budget", "committed"),
    [(100, 0), (100, 100), (7, 3), (1, 1)],
)
def test_the_cache_in_use_stays_a_fraction_from_0_to_1(budget: int, committed: int) -> None:
    admission = Admission(QueuePolicy(), capacity=2)
    admission.resize_budget(budget)
    held = admission.enter(1, committed) if committed else None
    assert read(admission).kv_usage == pytest.approx(committed / budget)
    if held is not None:
        held.release()


async def test_the_picker_scraping_a_sidecar_reads_its_line_and_its_slots(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot()
    url = gate.url + "/v1/chat/completions"

    async def reading() -> Reading:
        # As the picker's metrics-data-source: GET /metrics on the pool's target port, the
        # whole page (slotgate's series, then llama-server's own).
        answer = await client.get(gate.url + "/metrics")
        assert answer.status_code == 200
        return scrape(answer.text, ENGINE_CONFIG)

    assert await reading() == Reading(0, 0, 0.0)
    busy = [asyncio.create_task(client.post(url, json=chat()))]
    await gate.until(lambda: gate.service.admission.active == 1)
    busy.append(asyncio.create_task(client.post(url, json=chat())))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert await reading() == Reading(1, 1, 1.0)
    standin.hurry()
    assert [answer.status_code for answer in await asyncio.gather(*busy)] == [200, 200]
    await gate.until(lambda: gate.service.admission.active == 0)
    assert await reading() == Reading(0, 0, 0.0)
