"""Several slotgate replicas sharing one line through a real valkey-server (REDIS_URL), over
real sockets, in front of stand-in llama-servers: one pool of slots whichever replica a request
came to, the hand-off across replicas, the fallback when Redis is away, and what operators see."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from slotgate.logs import JsonFormatter
from slotgate.settings import Settings

from tests.conftest import (
    CHAT,
    RunningGate,
    StartUpstreams,
    assert_lines,
    cancel_all,
    chat,
    probed,
    replica_view,
    serve,
)
from tests.support.partition import Partition
from tests.support.standin import StandIn
from tests.support.valkey import Valkey

Gates = Callable[..., Any]


@pytest.fixture
def replicas(standin: StandIn, valkey: Valkey, served: list[RunningGate]) -> Gates:
    """Start `n` slotgates sharing `valkey` in front of the stand-in; each waits until it is
    in shared mode and Redis knows the stand-in's slots."""

    async def start(n: int = 2, **overrides: Any) -> list[RunningGate]:
        values: dict[str, Any] = {
            "llama_server_url": standin.url, "props_refresh_interval_s": 0.2,
            "keepalive_interval_s": 0, "log_level": "warning", "redis_url": valkey.url,
            "redis_fleet": "test", "redis_ttl_s": 1.5, "redis_timeout_s": 1.0,
        }  # fmt: skip
        # Redis calls may take a second on a loaded machine: a replica that fell back holding
        # nothing would answer 503 (the partition's safety), which only the tests of falling
        # back are about; they kill Valkey (refused at once) or set their own timeouts.
        values.update(overrides)
        made = []
        for _ in range(n):
            gate = await serve(Settings(_env_file=None, **values))
            served.append(gate)
            made.append(gate)
        for gate in made:
            # Each knows the others too: a replica that falls back divides the slots by the
            # replicas it last heard of, and one that has not heard of its peers takes them all.
            await gate.until(knows(gate, standin.total_slots))
            await gate.until(probed(gate))
            await gate.until(lambda g=gate: fleet(g)["replicas"] >= n)  # type: ignore[misc]
        return made

    return start


def fleet(gate: RunningGate) -> dict[str, Any]:
    view: dict[str, Any] = replica_view(gate)["fleet"]
    return view


def knows(gate: RunningGate, slots: int) -> Callable[[], bool]:
    """Redis has told `gate` of the fleet's `slots`."""
    return lambda: fleet(gate)["capacity"] == slots


def idle(gate: RunningGate) -> Callable[[], bool]:
    """Redis has told `gate` that nothing is held or waits, fleet-wide."""
    return lambda: fleet(gate)["active"] == 0 and fleet(gate)["queued"] == 0


def mode(gate: RunningGate) -> str:
    replica = gate.service.gate
    return replica.mode


async def test_a_burst_through_two_replicas_never_runs_more_than_the_upstreams_slots(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient
) -> None:
    standin.total_slots = 2
    standin.token_delay_s = 0.02
    gates = await replicas(2, max_queue=4)
    answers = await asyncio.gather(
        *(client.post(gates[i % 2].url + CHAT, json=chat()) for i in range(24))
    )
    statuses = [answer.status_code for answer in answers]
    assert set(statuses) <= {200, 429}, statuses
    # Two run and four wait, fleet-wide: each replica alone would let 2 + 4 through.
    assert statuses.count(200) >= 6
    assert standin.max_running == 2
    refused = [answer for answer in answers if answer.status_code == 429]
    assert refused, "24 requests at once over 2 slots and a line of 4"
    for answer in refused:
        assert float(answer.headers["retry-after"]) >= 1
        snapshot = answer.json()["error"]["admission"]
        assert snapshot["capacity"] == 2
        assert snapshot["queue_limit"] == 4
    for gate in gates:
        await gate.until(idle(gate))


async def one_runs_one_waits(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient
) -> tuple[RunningGate, RunningGate, asyncio.Task[httpx.Response], asyncio.Task[httpx.Response]]:
    """Two replicas over one slot: a request runs through the first, one waits on the second."""
    standin.total_slots = 1
    standin.tokens = 1000  # until the test hurries it: a slow machine still sees one wait
    standin.token_delay_s = 0.02
    first, second = await replicas(2)
    running = asyncio.create_task(client.post(first.url + CHAT, json=chat()))
    await first.until(lambda: standin.running == 1)
    waiting = asyncio.create_task(client.post(second.url + CHAT, json=chat()))
    await second.until(lambda: queued(second) == 1)
    return first, second, running, waiting


async def test_a_release_on_one_replica_hands_the_slot_to_a_waiter_on_the_other(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient
) -> None:
    _, second, running, waiting = await one_runs_one_waits(standin, replicas, client)
    assert not waiting.done()
    standin.hurry()
    assert (await running).status_code == 200
    answer = await waiting
    assert answer.status_code == 200
    assert standin.max_running == 1
    admission = (await client.get(second.url + "/admission")).json()
    assert (
        admission["upstreams"][0]["routed"]["load"]
        + admission["upstreams"][0]["routed"]["affinity"]
        == 1
    )


def queued(gate: RunningGate) -> int:
    count: int = replica_view(gate)["this_replica"]["queued"]
    return count


async def test_admission_metrics_and_readyz_show_the_shared_line_and_this_replicas_part(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient
) -> None:
    standin.total_slots = 3
    (gate,) = await replicas(1)
    admission = (await client.get(gate.url + "/admission")).json()
    replication = admission["replication"]
    assert replication["mode"] == "shared"
    assert replication["fleet"]["capacity"] == 3
    assert replication["fleet"]["replicas"] == 1
    assert replication["this_replica"] == {"active": 0, "queued": 0}
    assert replication["fallbacks"] == 0
    ready = await client.get(gate.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["replication"] == "shared"
    metrics = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert_lines(
        metrics,
        'slotgate_replication_mode{mode="shared"} 1.0',
        'slotgate_replication_mode{mode="degraded"} 0.0',
        "slotgate_replication_fallbacks_total 0.0",
        "slotgate_fleet_capacity 3.0",
    )


async def test_without_redis_url_admission_says_this_process_admits_alone(
    standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await serve(Settings(_env_file=None, llama_server_url=standin.url, log_level="warning"))
    try:
        admission = (await client.get(gate.url + "/admission")).json()
        assert admission["replication"] == {"mode": "local"}
        metrics = (await client.get(gate.url + "/metrics?source=slotgate")).text
        assert "slotgate_replication_mode" not in metrics
    finally:
        await gate.stop()


def test_without_redis_url_no_redis_code_is_loaded() -> None:
    code = (
        "import sys; from slotgate.main import create_app; from slotgate.settings import "
        "Settings; create_app(Settings(_env_file=None)); "
        "print(sorted(m for m in sys.modules if m.startswith(('redis', 'slotgate.shared', "
        "'slotgate.replica'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_redis_away_falls_back_to_this_replicas_share_and_readyz_stays_ready(
    standin: StandIn, valkey: Valkey, replicas: Gates, client: httpx.AsyncClient
) -> None:
    standin.total_slots = 2
    first, second = await replicas(2)
    valkey.kill()
    answers = await asyncio.gather(
        *(client.post(g.url + CHAT, json=chat()) for g in (first, second) for _ in range(3))
    )
    assert [a.status_code for a in answers] == [200] * 6
    for gate in (first, second):
        assert mode(gate) == "degraded"
        ready = await client.get(gate.url + "/readyz")
        assert (ready.status_code, ready.json()["replication"]) == (200, "degraded")
        metrics = (await client.get(gate.url + "/metrics?source=slotgate")).text
        assert "slotgate_replication_fallbacks_total 1.0" in metrics
    # Each replica gates on its share of the two slots: one each.
    assert standin.max_running <= 2
    valkey.start()
    for gate in (first, second):
        async with asyncio.timeout(5):
            while mode(gate) != "shared":
                await asyncio.sleep(0.05)
    answer = await client.post(first.url + CHAT, json=chat())
    assert answer.status_code == 200


# Slow (its requests must outlast the TTL, about 10 s each): scripts/check runs it.
@pytest.mark.slow
@pytest.mark.parametrize("failure_mode", ["local", "reject"])
async def test_one_replica_cut_off_from_redis_never_lets_the_upstream_run_more_than_its_slots(
    failure_mode: str,
    standin: StandIn,
    valkey: Valkey,
    replicas: Gates,
    client: httpx.AsyncClient,
    start_upstreams: StartUpstreams,
) -> None:
    standin.total_slots = 4
    # Requests that outlast the TTL: some still run when Redis gives their replica up.
    standin.tokens = 40
    standin.token_delay_s = 0.05
    partition = Partition(valkey.port)
    await start_upstreams(partition)
    settings = {"redis_ttl_s": 1.0, "redis_failure_mode": failure_mode}
    (cut,) = await replicas(1, redis_url=partition.url, **settings)
    (other,) = await replicas(1, **settings)
    for gate in (cut, other):
        await gate.until(lambda g=gate: fleet(g)["replicas"] == 2)
    load = asyncio.Event()

    async def clients(gate: RunningGate) -> None:
        while not load.is_set():
            answer = await client.post(gate.url + CHAT, json=chat())
            assert answer.status_code in (200, 429, 503)
            if answer.status_code != 200:
                await asyncio.sleep(0.05)

    busy = [asyncio.create_task(clients(g)) for g in (cut, other) for _ in range(4)]
    try:
        await other.until(lambda: standin.running == 4)
        partition.cut()
        await cut.until(lambda: mode(cut) != "shared")
        # Past the cut-off replica's TTL: Redis has given it up, the other still serves.
        await asyncio.sleep(3)
        assert mode(other) == "shared"
    finally:
        load.set()
        await asyncio.gather(*busy)
    assert standin.max_running <= 4
    partition.heal()
    async with asyncio.timeout(10):
        while mode(cut) != "shared":
            await asyncio.sleep(0.05)
    await other.until(idle(other))


async def test_reject_mode_answers_503_and_is_not_ready_while_redis_is_away(
    standin: StandIn, valkey: Valkey, replicas: Gates, client: httpx.AsyncClient
) -> None:
    (gate,) = await replicas(1, redis_failure_mode="reject")
    valkey.kill()
    answer = await client.post(gate.url + CHAT, json=chat())
    assert answer.status_code == 503
    assert "retry-after" in answer.headers
    ready = await client.get(gate.url + "/readyz")
    assert ready.status_code == 503
    assert ready.json()["replication"] == "rejecting"
    assert "REDIS_FAILURE_MODE=reject" in ready.json()["reason"]


async def test_a_waiter_that_leaves_on_one_replica_leaks_nothing_in_the_fleet(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient
) -> None:
    first, second, running, leaving = await one_runs_one_waits(standin, replicas, client)
    leaving.cancel()
    await second.until(lambda: queued(second) == 0)
    standin.hurry()
    assert (await running).status_code == 200
    for gate in (first, second):
        await gate.until(idle(gate))
    assert standin.started == 1


async def test_a_draining_replica_turns_its_waiters_away_and_its_place_leaves_the_fleets_line(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient
) -> None:
    first, second, running, waiting = await one_runs_one_waits(standin, replicas, client)
    second.service.drain()
    answer = await waiting
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "unavailable_error"
    refused = await client.post(second.url + CHAT, json=chat())
    assert refused.status_code == 503
    standin.hurry()
    assert (await running).status_code == 200
    await first.until(idle(first))
    assert standin.started == 1


async def test_a_replica_that_stops_hands_back_what_it_held_and_leaves_the_count(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient
) -> None:
    standin.total_slots = 2
    first, second = await replicas(2)
    await first.until(lambda: fleet(first)["replicas"] == 2)
    await second.stop()
    await first.until(lambda: fleet(first)["replicas"] == 1)
    assert (await client.post(first.url + CHAT, json=chat())).status_code == 200


def said(text: str, key: str) -> dict[str, Any]:
    """Keyword arguments of a chat request whose prompt names it, sent with `key`."""
    return {
        "json": {"messages": [{"role": "user", "content": text}], "stream": False},
        "headers": {"authorization": f"Bearer {key}"},
    }


async def test_a_tenants_chat_on_one_replica_goes_ahead_of_anothers_flood_on_the_other(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient, keys_file: Path
) -> None:
    standin.total_slots = 1
    standin.tokens, standin.token_delay_s = 10, 0.02
    # A loaded machine must not push a replica into its fallback, where (holding nothing) it
    # would turn the flood away: this is about the shared line.
    first, second = await replicas(
        2, api_keys_file=keys_file, max_queue=0, redis_timeout_s=1.0, redis_ttl_s=1.5
    )
    flood = [
        asyncio.create_task(client.post(first.url + CHAT, **said(f"flood {n}", "sk-flood")))
        for n in range(60)
    ]
    try:
        await first.until(lambda: fleet(first)["queued"] >= 50)
        for n in range(3):
            before = len(standin.seen)
            answer = await client.post(second.url + CHAT, **said(f"chat {n}", "sk-chat"))
            assert answer.status_code == 200
            seen = [json.loads(s.body)["messages"][0]["content"] for s in standin.seen[before:]]
            # Behind about 50 of the flood in the fleet's line, yet the next slot is its own.
            assert seen.index(f"chat {n}") <= standin.total_slots, seen
    finally:
        await cancel_all(flood)


async def test_a_tenants_max_queued_holds_across_replicas(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient, keys_file: Path
) -> None:
    standin.total_slots = 1
    standin.tokens, standin.token_delay_s = 40, 0.02
    first, second = await replicas(2, api_keys_file=keys_file)
    held = [
        asyncio.create_task(client.post(gate.url + CHAT, **said(f"job {n}", "sk-jobs")))
        for n, gate in enumerate((first, second, first))
    ]
    try:
        # One runs, two wait (one on each replica): the tenant's two places, fleet-wide.
        await first.until(lambda: fleet(first)["queued"] == 2)
        refused = await client.post(second.url + CHAT, **said("job 3", "sk-jobs"))
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "tenant_queue_full"
        assert error["admission"]["tenant"]["name"] == "jobs"
        standin.hurry()
        other = await client.post(second.url + CHAT, **said("chat", "sk-chat"))
        assert other.status_code == 200
    finally:
        await cancel_all(held)


async def test_a_request_asking_more_slots_than_its_tenants_max_active_is_refused_by_a_replica(
    standin: StandIn, replicas: Gates, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    standin.total_slots = 4
    path = tmp_path / "keys.toml"
    path.write_text('[tenants.capped]\nkey = "sk-capped"\nmax_active = 2\n')
    first, _ = await replicas(2, api_keys_file=path)
    asked = {"messages": [{"role": "user", "content": "hi"}], "n": 3}
    refused = await client.post(
        first.url + CHAT, json=asked, headers={"authorization": "Bearer sk-capped"}
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "too_many_slots"
    assert "max_active=2" in refused.json()["error"]["message"]
    assert standin.max_running == 0


async def test_a_replicas_served_request_counts_its_slot_hold_and_logs_its_own_queue_wait(
    standin: StandIn,
    replicas: Gates,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The request's account is kept after its slot went back: what it held, and for how
    # long, must still be known then (the hold histogram, the minute's slot-time, the log).
    standin.token_delay_s = 0.05
    (gate,) = await replicas(1)
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 200
    (record,) = [r for r in caplog.records if r.name == "slotgate.access"]
    line = json.loads(JsonFormatter().format(record))
    assert line["slot_hold_s"] is not None
    assert line["slot_hold_s"] > 0
    assert line["queue_wait_s"] < line["slot_hold_s"]
    metrics = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert_lines(metrics, 'slotgate_slot_hold_seconds_count{family="chat"} 1.0')
