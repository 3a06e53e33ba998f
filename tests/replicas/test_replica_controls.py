"""The operator controls on replicas sharing a line through Redis: a pause holds the replica it
is sent to (shared, before the shared line; degraded, in its own core), never losing a waiter;
a drain keeps the shared line from granting the upstream to any replica."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from slotgate.replicas.replica import ReplicaAdmission
from slotgate.settings import Settings

from tests.conftest import CHAT, RunningGate, StartUpstreams, chat, replica_view, serve
from tests.support.standin import StandIn
from tests.support.valkey import Valkey, free_port


async def sharing(
    valkey_url: str, served: list[RunningGate], upstreams: Sequence[StandIn], **overrides: Any
) -> RunningGate:
    values: dict[str, Any] = {
        "llama_server_url": ",".join(u.url for u in upstreams),
        "props_refresh_interval_s": 0.2, "keepalive_interval_s": 0, "log_level": "warning",
        "redis_url": valkey_url, "redis_fleet": "controls", "redis_ttl_s": 1.5,
        "redis_timeout_s": 1.0,
    }  # fmt: skip
    values.update(overrides)
    gate = await serve(Settings(_env_file=None, **values))
    served.append(gate)
    await gate.until(lambda: all(u.ready for u in gate.service.fleet))
    return gate


async def test_a_paused_replica_holds_its_new_requests_while_the_others_admit(
    valkey: Valkey,
    served: list[RunningGate],
    start_upstreams: StartUpstreams,
    client: httpx.AsyncClient,
) -> None:
    standin = StandIn(total_slots=2, tokens=3)
    await start_upstreams(standin)
    paused, other = [await sharing(valkey.url, served, [standin]) for _ in range(2)]
    await paused.until(lambda: replica_view(paused)["fleet"]["capacity"] == 2)
    assert (await client.post(paused.url + "/admin/pause")).status_code == 200
    held = [asyncio.create_task(client.post(paused.url + CHAT, json=chat())) for _ in range(2)]
    replica = paused.service.gate
    assert isinstance(replica, ReplicaAdmission)
    await paused.until(lambda: replica.held_back == 2)
    # Free slots, yet it holds them back; the other replica admits as ever.
    assert (await client.post(other.url + CHAT, json=chat())).status_code == 200
    assert not any(task.done() for task in held)
    assert standin.started == 1
    assert (await client.get(paused.url + "/admission")).json()["paused"] is True
    assert (await client.post(paused.url + "/admin/resume")).status_code == 200
    answers = await asyncio.gather(*held)
    assert [a.status_code for a in answers] == [200, 200]


async def test_a_paused_replica_gating_alone_never_loses_a_waiter(
    served: list[RunningGate], start_upstreams: StartUpstreams, client: httpx.AsyncClient
) -> None:
    standin = StandIn(total_slots=1, tokens=3)
    await start_upstreams(standin)
    # Nobody listens there: the replica gates alone on its core from the start.
    gate = await sharing(f"redis://127.0.0.1:{free_port()}", served, [standin])
    await gate.until(lambda: replica_view(gate)["mode"] == "degraded")
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    assert (await client.post(gate.url + "/admin/pause")).status_code == 200
    waiters = [asyncio.create_task(client.post(gate.url + CHAT, json=chat())) for _ in range(3)]
    await gate.until(lambda: replica_view(gate)["this_replica"]["queued"] == 3)
    await asyncio.sleep(0.2)  # a free slot, and nobody may be granted it
    assert standin.started == 1
    assert not any(task.done() for task in waiters)
    assert (await client.post(gate.url + "/admin/resume")).status_code == 200
    answers = await asyncio.gather(*waiters)
    assert [a.status_code for a in answers] == [200] * 3


@pytest.mark.parametrize("asked", ["drained", "other"])
async def test_an_upstream_drained_on_one_replica_is_granted_to_no_replica(
    valkey: Valkey,
    served: list[RunningGate],
    start_upstreams: StartUpstreams,
    client: httpx.AsyncClient,
    asked: str,
) -> None:
    kept, drained = StandIn(total_slots=1, tokens=3), StandIn(total_slots=1, tokens=3)
    await start_upstreams(kept, drained)
    first, second = [await sharing(valkey.url, served, [kept, drained]) for _ in range(2)]
    await first.until(lambda: replica_view(first)["fleet"]["capacity"] == 2)
    name = next(u.name for u in first.service.fleet if u.url == drained.url)
    assert (await client.post(first.url + f"/admin/upstreams/{name}/drain")).status_code == 200
    await second.until(lambda: replica_view(second)["fleet"]["capacity"] == 1)
    gate = first if asked == "drained" else second
    for _ in range(6):
        assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    assert (drained.started, kept.started) == (0, 6)
    assert (await client.post(first.url + f"/admin/upstreams/{name}/restore")).status_code == 200
    await second.until(lambda: replica_view(second)["fleet"]["capacity"] == 2)


@pytest.fixture
async def one_replica(
    valkey: Valkey, served: list[RunningGate], start_upstreams: StartUpstreams
) -> tuple[StandIn, RunningGate, ReplicaAdmission]:
    """One replica on the shared line before a one-slot stand-in, its slots known in Redis."""
    standin = StandIn(total_slots=1, tokens=3)
    await start_upstreams(standin)
    gate = await sharing(valkey.url, served, [standin], max_queue=2)
    await gate.until(lambda: replica_view(gate)["fleet"]["capacity"] == 1)
    replica = gate.service.gate
    assert isinstance(replica, ReplicaAdmission)
    return standin, gate, replica


async def test_a_request_a_paused_replica_holds_back_can_leave_or_be_cancelled(
    one_replica: tuple[StandIn, RunningGate, ReplicaAdmission], client: httpx.AsyncClient
) -> None:
    standin, gate, replica = one_replica
    assert (await client.post(gate.url + "/admin/pause")).status_code == 200
    # A client that gives up while held back leaves no ghost counted against the line.
    leaving = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: replica.held_back == 1)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await gate.until(lambda: replica.held_back == 0)
    # An operator can cancel one held back, as any waiter.
    cancelled = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": "held-1"})
    )
    await gate.until(lambda: "held-1" in gate.service.proxy.running)
    assert (await client.post(gate.url + "/admin/requests/held-1/cancel")).status_code == 200
    answer = await cancelled
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "cancelled_by_operator"
    assert replica.held_back == 0
    # One held back still goes on at the resume.
    kept = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: replica.held_back == 1)
    assert (await client.post(gate.url + "/admin/resume")).status_code == 200
    assert (await kept).status_code == 200
    assert standin.started == 1
