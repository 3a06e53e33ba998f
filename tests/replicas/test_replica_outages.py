"""The shared line (REDIS_URL) pushed where a fleet pushes it: upstreams that refuse, every
upstream down, clients that leave, Redis paused or slow; over real sockets, a real valkey-server
and stand-in llama-servers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from slotgate.gate.admission import Admission
from slotgate.main import create_app
from slotgate.replicas.replica import ReplicaAdmission
from slotgate.replicas.shared import SharedAdmission
from slotgate.settings import Settings

from tests.conftest import CHAT, RunningGate, StartUpstreams, chat, probed, replica_view, serve
from tests.support.entries import entry
from tests.support.standin import StandIn
from tests.support.valkey import Valkey

Start = Callable[..., Any]


@pytest.fixture
def sharing(valkey: Valkey, served: list[RunningGate]) -> Start:
    """Start one slotgate sharing `valkey` in front of the given stand-ins; waits until Redis
    knows every upstream's slots."""

    async def start(upstreams: Sequence[StandIn], **overrides: Any) -> RunningGate:
        values: dict[str, Any] = {
            "llama_server_url": ",".join(u.url for u in upstreams),
            "props_refresh_interval_s": 0.2, "keepalive_interval_s": 0, "log_level": "warning",
            # A Redis call a loaded machine delays by a few hundred milliseconds is not an
            # outage: tests that count fallbacks must not see one more.
            "redis_url": valkey.url, "redis_fleet": "edges", "redis_ttl_s": 1.5,
            "redis_timeout_s": 1.0,
        }  # fmt: skip
        values.update(overrides)
        gate = await serve(Settings(_env_file=None, **values))
        served.append(gate)
        slots = sum(u.total_slots for u in upstreams)
        await gate.until(lambda: replica_view(gate)["fleet"]["capacity"] == slots)
        await gate.until(probed(gate, len(upstreams)))
        return gate

    return start


async def redis_idle(gate: RunningGate) -> None:
    """Wait until Redis holds nothing of the fleet's and this replica holds nothing."""

    def idle() -> bool:
        heard = replica_view(gate)
        return bool(
            heard["fleet"]["active"] == 0
            and heard["fleet"]["queued"] == 0
            and heard["this_replica"] == {"active": 0, "queued": 0}
        )

    await gate.until(idle)


async def test_a_request_refused_by_its_upstream_runs_on_the_other_and_leaves_nothing_in_redis(
    sharing: Start, client: httpx.AsyncClient
) -> None:
    alive, dead = StandIn(total_slots=2, tokens=3), StandIn(total_slots=2, tokens=3)
    for upstream in (alive, dead):
        await upstream.start()
    # The stopped upstream's port stays taken (bound, not listening: every connection is
    # refused): on a busy machine another test's server could listen there and never answer.
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past its closed connections
    try:
        gate = await sharing([alive, dead], props_refresh_interval_s=30, startup_wait_s=0)
        await dead.stop()
        held.bind((dead.host, dead.port))
        bodies = [chat(messages=[{"role": "user", "content": str(n)}]) for n in range(12)]
        async with asyncio.timeout(20):
            answers = await asyncio.gather(*(client.post(gate.url + CHAT, json=b) for b in bodies))
        assert [a.status_code for a in answers] == [200] * 12
        assert alive.started == 12
        await redis_idle(gate)
    finally:
        held.close()
        await alive.stop()


async def test_a_request_sent_back_while_every_upstream_is_down_is_refused_not_left_waiting(
    sharing: Start, client: httpx.AsyncClient
) -> None:
    dead = StandIn(total_slots=1, tokens=3)
    await dead.start()
    # Heartbeats a second apart: the fleet's figures the replica holds are older than the wait.
    gate = await sharing([dead], props_refresh_interval_s=30, startup_wait_s=0.2, redis_ttl_s=3)
    await dead.stop()
    async with asyncio.timeout(5):
        answer = await client.post(gate.url + CHAT, json=chat())
    assert answer.status_code == 503
    assert "retry-after" in answer.headers
    await redis_idle(gate)


async def test_a_waiting_streams_position_falls_as_the_fleets_line_ahead_of_it_is_served(
    sharing: Start, client: httpx.AsyncClient, start_upstreams: StartUpstreams
) -> None:
    standin = StandIn(total_slots=1, tokens=10, token_delay_s=0.03)
    await start_upstreams(standin)
    gate = await sharing([standin], keepalive_interval_s=0.05, stream_head_after_s=0)
    ahead = [asyncio.create_task(client.post(gate.url + CHAT, json=chat())) for _ in range(2)]
    await gate.until(lambda: replica_view(gate)["this_replica"] == {"active": 1, "queued": 1})
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as answer:
        positions = [
            int(line.split("=")[1].split()[0])
            async for line in answer.aiter_lines()
            if line.startswith(": queued position=")
        ]
    assert [a.status_code for a in await asyncio.gather(*ahead)] == [200, 200]
    # Second in the line when it came, first once the request that ran before it ended.
    assert positions[0] == 2
    assert positions[-1] == 1
    await redis_idle(gate)


SharedLine = Callable[[str, str], Awaitable[SharedAdmission]]


@pytest.fixture
async def shared_line(valkey: Valkey) -> AsyncIterator[SharedLine]:
    """Start a replica's line shared on `valkey` (its fleet's name, its own), without a
    slotgate around it; each is closed at the test's end."""
    opened: list[SharedAdmission] = []

    async def start(fleet: str, replica: str) -> SharedAdmission:
        # A loaded machine can stall a call past a fraction of a second; a line that then falls
        # back gates alone, and these tests mean it shared.
        admission = SharedAdmission(
            valkey.url, fleet, replica=replica, heartbeat_s=0.2, ttl_s=1.0, timeout_s=1.0
        )
        opened.append(admission)
        await admission.start()
        return admission

    yield start
    for admission in opened:
        await admission.close()


def fallbacks(gate: RunningGate) -> int:
    count: int = replica_view(gate)["fallbacks"]
    return count


async def test_redis_paused_while_a_request_runs_and_one_waits_answers_both_and_falls_back_once(
    sharing: Start, valkey: Valkey, client: httpx.AsyncClient, start_upstreams: StartUpstreams
) -> None:
    standin = StandIn(total_slots=1, tokens=20, token_delay_s=0.02)
    await start_upstreams(standin)
    first, second = [await sharing([standin]) for _ in range(2)]
    running = asyncio.create_task(client.post(first.url + CHAT, json=chat()))
    await first.until(lambda: standin.running == 1)
    waiting = asyncio.create_task(client.post(second.url + CHAT, json=chat()))
    await second.until(lambda: replica_view(second)["this_replica"]["queued"] == 1)
    valkey.pause()
    # Longer than a heartbeat and its timeout, so that each replica falls back once.
    await asyncio.sleep(2.5)
    valkey.resume()
    async with asyncio.timeout(5):
        answers = await asyncio.gather(running, waiting)
    assert [a.status_code for a in answers] == [200, 200]
    # Shared again, and it stays so: one fallback per replica for the one pause.
    await shared_again_after_one_fallback(client, (first, second))


def heard(gate: RunningGate, mode: str, capacity: int | None) -> bool:
    """`gate` is in `mode`, and Redis told it the fleet's `capacity` (if given)."""
    seen = replica_view(gate)
    return bool(seen["mode"] == mode and capacity in (None, seen["fleet"]["capacity"]))


async def shared_again_after_one_fallback(
    client: httpx.AsyncClient, gates: Sequence[RunningGate], capacity: int | None = None
) -> None:
    """Each replica is shared again (and told the fleet's `capacity`, if given), serves three
    requests and stays shared, with one fallback counted, and nothing left held in Redis."""
    for gate in gates:
        await gate.until(partial(heard, gate, "shared", capacity))
    more = await asyncio.gather(
        *(client.post(g.url + CHAT, json=chat()) for g in gates for _ in range(3))
    )
    assert [a.status_code for a in more] == [200] * 3 * len(gates)
    for gate in gates:
        assert replica_view(gate)["mode"] == "shared"
        assert fallbacks(gate) == 1
        await redis_idle(gate)


async def test_redis_restarted_empty_brings_shared_mode_back_with_one_fallback(
    sharing: Start, valkey: Valkey, client: httpx.AsyncClient, start_upstreams: StartUpstreams
) -> None:
    standin = StandIn(total_slots=2, tokens=20, token_delay_s=0.02)
    await start_upstreams(standin)
    first, second = [await sharing([standin]) for _ in range(2)]
    running = [asyncio.create_task(client.post(g.url + CHAT, json=chat())) for g in (first, second)]
    await first.until(lambda: standin.running == 2)
    valkey.kill()
    valkey.start()
    async with asyncio.timeout(5):
        answers = await asyncio.gather(*running)
    assert [a.status_code for a in answers] == [200, 200]
    await shared_again_after_one_fallback(client, (first, second), capacity=2)


def by_name(valkey: Valkey, port: int) -> Settings:
    """A slotgate sharing `valkey` in front of `localhost:port`, a name that the test's own
    resolver resolves."""
    return Settings(
        _env_file=None,
        llama_server_url=f"http://localhost:{port}",
        props_refresh_interval_s=0.1, keepalive_interval_s=0, log_level="warning",
        redis_url=valkey.url, redis_fleet="edges", redis_ttl_s=1.5, redis_timeout_s=1.0,
    )  # fmt: skip


async def test_an_upstream_renamed_when_its_name_resolves_to_more_addresses_keeps_its_grants(
    valkey: Valkey, client: httpx.AsyncClient
) -> None:
    first = StandIn(total_slots=1, host="127.0.0.1", tokens=40, token_delay_s=0.02)
    await first.start()
    second = StandIn(total_slots=1, host="127.0.0.2", port=first.port, tokens=3)
    addresses = ["127.0.0.1"]

    async def resolver(host: str, port: int) -> list[str]:
        return list(addresses)

    settings = by_name(valkey, first.port)
    gate = None
    try:
        await second.start()
        gate = await serve(settings, create_app(settings, resolver))
        await gate.until(lambda: replica_view(gate)["fleet"]["capacity"] == 1)
        running = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
        await gate.until(lambda: first.running == 1)
        addresses.append("127.0.0.2")  # the name's one server is one of two now
        await gate.until(lambda: replica_view(gate)["fleet"]["capacity"] == 2)
        more = await asyncio.gather(*(client.post(gate.url + CHAT, json=chat()) for _ in range(3)))
        assert [a.status_code for a in more] == [200] * 3
        assert (await running).status_code == 200
        # The running request still held the first server's one slot in the fleet's count.
        assert first.max_running == 1
        assert second.max_running == 1
        await redis_idle(gate)
    finally:
        if gate is not None:
            await gate.stop()
        for upstream in (first, second):
            await upstream.stop()


async def test_a_rekeyed_upstream_moves_only_this_replicas_grants_and_they_come_back_in_full(
    shared_line: SharedLine, redis: aioredis.Redis
) -> None:
    renaming = await shared_line("rekey", "r0")
    other = await shared_line("rekey", "r1")
    prefix = "slotgate:{rekey}:"
    await renaming.resize("name", 2, budget=100)
    mine = await renaming.enter(entry(cost=30))
    theirs = await other.enter(entry(cost=40))
    assert (mine.upstream, theirs.upstream) == ("name", "name")
    await renaming.rekey("name", "address")
    await renaming.resize("address", 2, budget=100)
    assert mine.upstream == "address"
    active = await redis.hgetall(prefix + "active")
    assert (active[b"name"], active[b"address"]) == (b"1", b"1")
    assert await redis.hget(prefix + "tokens", "address") == b"30"
    # The new name has one slot left, not two.
    assert (await renaming.enter(entry())).granted
    assert not (await renaming.enter(entry())).granted
    for ticket in (mine, theirs):
        await ticket.aclose()


async def test_a_replica_that_starts_never_takes_a_known_upstream_out_of_the_fleets_pools(
    sharing: Start, redis: aioredis.Redis
) -> None:
    standin = StandIn(total_slots=2)
    await standin.start()
    pubsub = redis.pubsub()
    try:
        await sharing([standin])
        # Every change to the fleet's pools, as Valkey's keyspace events tell it.
        await redis.config_set("notify-keyspace-events", "Kh")
        await pubsub.subscribe("__keyspace@0__:slotgate:{edges}:pools")
        await sharing([standin])
        events = []
        while (message := await pubsub.get_message(timeout=0.2)) is not None:
            events.append(message["data"])
        # The second replica's first look at its upstream (its budget, before its slots) told
        # the fleet the upstream was unknown: every other replica answered 503 meanwhile.
        assert b"hdel" not in events, events
    finally:
        await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
        await standin.stop()


async def test_an_upstream_gone_from_the_pools_leaves_no_count_behind_once_its_last_grant_ends(
    shared_line: SharedLine, redis: aioredis.Redis
) -> None:
    admission = await shared_line("gone", "r0")
    # A fleet behind a DNS name whose addresses come and go (pods rolled): each one seen
    # once would stay a field read by every script call for good.
    for n in range(3):
        await admission.resize(f"http://10.0.0.{n}:8080", 1)
        ticket = await admission.enter(entry())
        await admission.resize(f"http://10.0.0.{n}:8080", None)
        await ticket.aclose()
    await admission.resize("http://10.0.0.9:8080", 1)
    assert await redis.hgetall("slotgate:{gone}:active") == {}


async def test_upstreams_that_leave_dns_one_after_another_are_not_remembered_by_the_replica(
    valkey: Valkey,
) -> None:
    settings = Settings(_env_file=None, redis_url=valkey.url, redis_fleet="churn")
    admission = Admission(settings.queue_policy)
    replica = ReplicaAdmission(settings, admission, valkey.url)
    await replica.start()
    try:
        for n in range(20):
            pool = admission.add_pool(f"http://10.0.0.{n}:8080")
            pool.resize(1)
            pool.retire()
            pool.resize(None)  # its follower's last look before it closes
            while replica._tasks:
                await asyncio.wait(list(replica._tasks))
        assert len(replica._told) == 0
    finally:
        await replica.close()


async def test_two_replicas_behind_one_name_count_its_one_server_once(
    valkey: Valkey,
) -> None:
    first = StandIn(total_slots=1, host="127.0.0.1")
    await first.start()
    second = StandIn(total_slots=1, host="127.0.0.2", port=first.port)
    await second.start()
    addresses = ["127.0.0.1", "127.0.0.2"]

    async def scaled(host: str, port: int) -> list[str]:
        return list(addresses)

    async def one(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    settings = by_name(valkey, first.port)
    gates: list[RunningGate] = []
    try:
        early = await serve(settings, create_app(settings, scaled))
        gates.append(early)
        await early.until(lambda: replica_view(early)["fleet"]["capacity"] == 2)
        addresses.remove("127.0.0.2")  # scaled down to one server
        await second.stop()
        await early.until(lambda: replica_view(early)["fleet"]["capacity"] == 1)
        late = await serve(settings, create_app(settings, one))  # started after the scale-down
        gates.append(late)
        await late.until(lambda: late.service.admission.capacity == 1)
        await asyncio.sleep(1.5)  # a few heartbeats
        assert replica_view(late)["fleet"]["capacity"] == 1
    finally:
        for gate in gates:
            await gate.stop()
        for upstream in (first, second):
            await upstream.stop()
