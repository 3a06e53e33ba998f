"""slotgate in front of several stand-in llama-servers, over real sockets: one line for the
fleet, no upstream above its slots, failover before a byte is sent, DNS discovery."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import pytest
from slotgate.gate.admission import Admission
from slotgate.gate.routing import score, stable_hash
from slotgate.gate.ticket import Ticket
from slotgate.logs import JsonFormatter
from slotgate.main import create_app
from slotgate.settings import Settings

from tests.conftest import CHAT, GatesFor, RunningGate, chat, serve
from tests.support.standin import StandIn

StandIns = Callable[..., Any]


@pytest.fixture
async def standins() -> AsyncIterator[StandIns]:
    """Start stand-ins with the given slot counts (and token delays); all stop at the end."""
    started: list[StandIn] = []

    async def start(slots: Sequence[int], delays: Sequence[float] | None = None) -> list[StandIn]:
        made = []
        for index, count in enumerate(slots):
            upstream = StandIn(total_slots=count, tokens=3)
            upstream.token_delay_s = delays[index] if delays else 0.01
            await upstream.start()
            made.append(upstream)
        started.extend(made)
        return made

    yield start
    for upstream in started:
        await upstream.stop()


@pytest.fixture
def gates(gates_for: GatesFor) -> Callable[..., Any]:
    """slotgate in front of the given stand-ins, once every one's slots are known."""

    async def start(upstreams: Sequence[StandIn], **overrides: Any) -> RunningGate:
        gate = await gates_for(list(upstreams), **overrides)
        await gate.until(lambda: all(p.capacity for p in gate.service.admission.pools))
        return gate

    return start


Fleet = Callable[..., Awaitable[tuple[RunningGate, list[StandIn]]]]


@pytest.fixture
def fleet(standins: StandIns, gates: Callable[..., Any]) -> Fleet:
    """slotgate before new stand-ins of the given slot counts, with the given settings; both
    stop at the end."""

    async def start(slots: Sequence[int], **overrides: Any) -> tuple[RunningGate, list[StandIn]]:
        upstreams = await standins(slots)
        gate: RunningGate = await gates(upstreams, **overrides)
        return gate, upstreams

    return start


async def test_a_mixed_crowd_through_a_fleet_is_all_answered_and_no_upstream_runs_above_its_slots(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstreams = await standins([1, 2, 3, 4], [0.004, 0.01, 0.002, 0.02])
    gate = await gates(upstreams, max_queue=30)
    await crowd(gate, client, upstreams, 200)


async def crowd(
    gate: RunningGate, client: httpx.AsyncClient, upstreams: Sequence[StandIn], count: int
) -> dict[int | str, int]:
    """`count` mixed requests at once, some leaving early; every one answered (or left), the
    line never above its limit, nothing held afterwards. Returns the statuses seen."""
    admission = gate.service.admission
    deepest = 0
    statuses: dict[int | str, int] = {}
    rng = random.Random(7)

    async def watch() -> None:
        nonlocal deepest
        while True:
            deepest = max(deepest, admission.queued)
            limit = admission.queue_limit
            # Beyond the limit only by requests an upstream sent back (they keep their turn).
            back = sum(1 for t in admission._line.tickets() if t.rerouted and not t._released)
            assert limit is None or admission.queued <= limit + back
            # Often enough to see the line at its deepest, not so often that its scan of the
            # line starves the loop it watches.
            await asyncio.sleep(0.01)

    async def one(n: int) -> None:
        stream = n % 2 == 0
        body = chat(stream=stream, messages=[{"role": "user", "content": f"c{n % 17}"}])
        try:
            async with client.stream("POST", gate.url + CHAT, json=body) as answer:
                text = await answer.aread()
            if answer.status_code == 200 and stream:
                assert text.endswith(b"data: [DONE]\n\n")
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
        except asyncio.CancelledError:
            statuses["left"] = statuses.get("left", 0) + 1
            raise

    watcher = asyncio.create_task(watch())
    tasks = [asyncio.create_task(one(n)) for n in range(count)]
    for task in rng.sample(tasks, count // 5):  # a fifth leave at a random moment
        asyncio.get_running_loop().call_later(rng.random() * 0.3, task.cancel)
    await asyncio.gather(*tasks, return_exceptions=True)
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    for upstream in upstreams:
        assert upstream.max_running <= upstream.total_slots, upstream.url
    assert set(statuses) <= {200, 429, "left"}
    assert sum(statuses.values()) == count
    assert statuses.get(200, 0) > 0
    await gate.until(lambda: admission.active == 0 and admission.queued == 0)
    assert all(pool.active == 0 and pool.committed == 0 for pool in admission.pools)
    await gate.until(lambda: all(u.running == 0 for u in upstreams))
    return statuses


@pytest.mark.slow
async def test_two_thousand_requests_over_eight_upstreams_survive_resizes_kills_and_restarts(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstreams = await standins([1, 2, 3, 4, 1, 2, 3, 4], [0.002 * (1 + n % 4) for n in range(8)])
    gate = await gates(upstreams, max_queue=600, startup_wait_s=5)

    async def trouble() -> None:
        await asyncio.sleep(0.3)
        upstreams[1].total_slots = 1  # a resize down: holders above it retire as they end
        upstreams[5].total_slots = 4  # and up
        await asyncio.sleep(0.3)
        upstreams[2].shutdown_timeout_s = 0.05
        await upstreams[2].stop()  # killed under load
        await asyncio.sleep(0.5)
        await upstreams[2].start()  # and back

    chaos = asyncio.create_task(trouble())
    statuses = await crowd(gate, client, upstreams, 2000)
    await chaos
    assert statuses.get(200, 0) >= 400  # a line's worth, less those who left
    for upstream in upstreams:
        assert upstream.max_running <= max(upstream.total_slots, 4)


async def test_a_refused_connection_goes_to_another_upstream_and_nothing_is_lost(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    alive, dead = await standins([2, 2])
    # slotgate reads /props rarely here, so it learns of the death from a refused request.
    gate = await gates([alive, dead], props_refresh_interval_s=30, startup_wait_s=0)
    await dead.stop()
    answers = await asyncio.gather(
        *(client.post(gate.url + CHAT, json=chat(messages=[{"role": "user", "content": str(n)}]))
          for n in range(12))
    )  # fmt: skip
    assert [a.status_code for a in answers] == [200] * 12
    assert alive.started == 12
    pools = gate.service.admission.pools
    assert pools[1].capacity is None  # marked down at once
    assert pools[0].routed["retry"] >= 1


async def test_a_down_upstream_is_back_in_rotation_soon_after_it_answers_again(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    first, second = await standins([1, 1])
    gate = await gates([first, second], props_refresh_interval_s=5)
    await second.stop()
    gate.service.fleet.upstreams[1].lost("stopped by the test")
    assert gate.service.admission.capacity == 1
    await second.start()
    loop = asyncio.get_running_loop()
    began = loop.time()
    await gate.until(lambda: gate.service.admission.capacity == 2)
    # Looked at every NOT_READY_RETRY_S (1 s) while down, not every PROPS_REFRESH_INTERVAL_S.
    assert loop.time() - began < 2.0
    answers = await asyncio.gather(*(client.post(gate.url + CHAT, json=chat()) for _ in range(4)))
    assert [a.status_code for a in answers] == [200] * 4
    assert second.started > 0


async def test_the_turns_of_a_conversation_stay_on_one_upstream(
    fleet: Fleet, client: httpx.AsyncClient
) -> None:
    gate, upstreams = await fleet([2, 2, 2])
    system = {"role": "system", "content": "You are a patient tutor. " * 40}
    for conversation in range(6):
        history: list[dict[str, str]] = [system, {"role": "user", "content": f"q{conversation}"}]
        for turn in range(3):
            answer = await client.post(gate.url + CHAT, json=chat(messages=history))
            assert answer.status_code == 200
            history += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "?"}]
            del turn
    # The shared long system prompt is the key: every turn of every conversation, one place.
    assert sorted(len(u.seen) for u in upstreams) == [0, 0, 18]
    keyed = await asyncio.gather(
        *(client.post(gate.url + CHAT, json=chat(prompt_cache_key=f"user-{n}")) for n in range(30))
    )
    assert all(a.status_code == 200 for a in keyed)
    assert all(len(u.seen) > 0 for u in upstreams)  # thirty keys spread over the fleet
    routed = [pool.routed for pool in gate.service.admission.pools]
    assert sum(r["affinity"] for r in routed) >= 18


async def test_least_loaded_routing_ignores_the_prompt(
    fleet: Fleet, client: httpx.AsyncClient
) -> None:
    gate, upstreams = await fleet([1, 1, 1], routing="least-loaded")
    answers = await asyncio.gather(*(client.post(gate.url + CHAT, json=chat()) for _ in range(3)))
    assert [a.status_code for a in answers] == [200] * 3
    assert [len(u.seen) for u in upstreams] == [1, 1, 1]  # all at once: one each
    assert sum(p.routed["affinity"] for p in gate.service.admission.pools) == 0


async def test_admission_and_metrics_show_each_upstream(
    fleet: Fleet, client: httpx.AsyncClient
) -> None:
    gate, upstreams = await fleet([1, 3])
    snapshot = (await client.get(gate.url + "/admission")).json()
    assert snapshot["capacity"] == 4
    assert [(u["url"], u["capacity"], u["ready"]) for u in snapshot["upstreams"]] == [
        (upstreams[0].url, 1, True),
        (upstreams[1].url, 3, True),
    ]
    assert snapshot["models_differ"] is False
    text = (await client.get(gate.url + "/metrics")).text
    for upstream in upstreams:
        label = f'upstream="{upstream.url}"'
        assert f"slotgate_upstream_slots_capacity{{{label}}} {upstream.total_slots}.0" in text
        assert f"llamacpp:requests_processing{{{label}}} 0" in text
    # Each of llama-server's families is declared once, for both upstreams' samples.
    assert text.count("# TYPE llamacpp:requests_processing gauge") == 1


async def test_a_name_that_resolves_to_several_addresses_is_one_upstream_per_address(
    client: httpx.AsyncClient,
) -> None:
    first = StandIn(total_slots=1, host="127.0.0.1")
    await first.start()
    others = [StandIn(total_slots=n + 2, host=f"127.0.0.{n + 2}", port=first.port) for n in (0, 1)]
    addresses = ["127.0.0.1", "127.0.0.2"]

    async def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("llama.fleet.test", first.port)
        return list(addresses)

    settings = Settings(
        _env_file=None,
        llama_server_url=f"http://llama.fleet.test:{first.port}",
        props_refresh_interval_s=0.1,
        log_level="warning",
    )
    gate = None
    try:
        for other in others:
            await other.start()
        gate = await serve(settings, create_app(settings, resolver))
        admission = gate.service.admission
        await gate.until(lambda: admission.capacity == 3)
        assert sorted(u.url for u in gate.service.fleet) == [
            f"http://127.0.0.1:{first.port}", f"http://127.0.0.2:{first.port}"
        ]  # fmt: skip
        answers = await asyncio.gather(
            *(client.post(gate.url + CHAT, json=chat()) for _ in range(3))
        )
        assert [a.status_code for a in answers] == [200] * 3
        # The Host header names the name, not the address.
        assert others[0].seen[-1].headers["Host"] == f"llama.fleet.test:{first.port}"
        addresses.append("127.0.0.3")  # a new address joins
        await gate.until(lambda: admission.capacity == 6)
        addresses.remove("127.0.0.1")  # and one leaves
        await gate.until(lambda: admission.capacity == 5)
        assert len(admission.pools) == 2
    finally:
        if gate is not None:
            await gate.stop()
        for upstream in (first, *others):
            await upstream.stop()


async def test_upstreams_that_serve_different_models_are_named_in_the_log_and_admission(
    standins: StandIns,
    gates: Callable[..., Any],
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstreams = await standins([1, 1])
    upstreams[1].model = "other.gguf"
    gate = await gates(upstreams)
    snapshot = (await client.get(gate.url + "/admission")).json()
    assert snapshot["models_differ"] is True
    assert [u["model"] for u in snapshot["upstreams"]] == ["standin.gguf", "other.gguf"]
    assert any(
        "different models (other.gguf, standin.gguf)" in record.getMessage()
        for record in caplog.records
    )


async def test_a_verbose_upstream_that_is_not_the_first_gets_non_streamed_requests_as_sent(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    plain, verbose = await standins([1, 1])
    verbose.verbose = True  # llama-server --verbose: __verbose cannot be rebuilt from a stream
    gate = await gates([plain, verbose])
    pools = gate.service.admission.pools
    key = next(
        f"user-{n}"
        for n in range(10_000)
        if max(pools, key=lambda p: score(stable_hash(f"key:user-{n}"), p.salt)) is pools[1]
    )
    answers = [
        await client.post(gate.url + CHAT, json=chat(prompt_cache_key=key)) for _ in range(3)
    ]
    assert [a.status_code for a in answers] == [200] * 3
    assert len(verbose.seen) == 3
    # Once one answer showed it, the others go as sent and carry llama-server's own object.
    assert b'"stream":true' not in verbose.seen[-1].body
    assert answers[-1].json()["__verbose"] == {"stream": False}


async def test_the_access_line_names_the_upstream_that_answered_and_none_for_a_refusal(
    fleet: Fleet, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    gate, upstreams = await fleet([1, 1])
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        served = await client.post(gate.url + CHAT, json=chat())
        refused = await client.post(gate.url + CHAT, json=chat(n=2))  # more than either has
    assert (served.status_code, refused.status_code) == (200, 400)
    lines = [
        json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "slotgate.access"
    ]
    answered_by = next(u.url for u in upstreams if u.seen)
    assert [line["upstream"] for line in lines] == [answered_by, None]


def on_first_upstream(admission: Admission) -> Ticket:
    """A slot held on the first upstream, the others left as they were."""
    taken = [admission.enter() for _ in admission.pools]
    for ticket in taken:
        if ticket.pool is not admission.pools[0]:
            ticket.release()
    (squatter,) = (t for t in taken if t.pool is admission.pools[0])
    return squatter


async def first_upstream_dead_and_held(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> tuple[RunningGate, StandIn, Ticket, asyncio.Task[httpx.Response]]:
    """Two upstreams of one slot; the first stopped (slotgate learns of it only from a refused
    request), its slot held by a squatter, the second's by a long stream: both busy."""
    dead, alive = await standins([1, 1], [0.01, 0.2])
    gate = await gates(
        [dead, alive],
        props_refresh_interval_s=30,
        keepalive_interval_s=0.05,
        stream_head_after_s=0,
        startup_wait_s=0,
    )
    admission = gate.service.admission
    await dead.stop()
    squatter = on_first_upstream(admission)
    long = asyncio.create_task(client.post(gate.url + CHAT, json=chat(stream=True)))
    await gate.until(lambda: admission.active == 2)
    return gate, alive, squatter, long


@contextlib.asynccontextmanager
async def queued_stream(
    client: httpx.AsyncClient, gate: RunningGate
) -> AsyncIterator[tuple[str, AsyncIterator[str]]]:
    """A stream whose head went out while it waits in the line: its first chunk (a queued
    comment), and the rest of them."""
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        assert response.status_code == 200
        chunks = response.aiter_text()
        first = await anext(chunks)
        assert first.startswith(": queued")
        yield first, chunks


async def test_a_waiting_stream_whose_head_went_out_is_sent_elsewhere_when_its_upstream_refuses(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    gate, alive, squatter, long = await first_upstream_dead_and_held(standins, gates, client)
    async with queued_stream(client, gate) as (first, chunks):
        squatter.release()  # its turn comes on the dead upstream, which refuses it
        text = first + "".join([chunk async for chunk in chunks])
    admission = gate.service.admission
    assert text.rstrip().endswith("data: [DONE]")
    assert '"error"' not in text
    assert (await long).status_code == 200
    assert admission.pools[0].capacity is None
    assert admission.pools[1].routed["retry"] == 1
    assert len(alive.seen) == 2


async def test_a_stream_that_leaves_while_sent_back_to_the_line_frees_its_place(
    standins: StandIns, gates: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    gate, alive, squatter, long = await first_upstream_dead_and_held(standins, gates, client)
    admission = gate.service.admission
    async with queued_stream(client, gate):
        squatter.release()
        await gate.until(lambda: admission.pools[0].capacity is None)  # refused: sent back
        assert (admission.active, admission.queued) == (1, 1)
    # The client left while it waited again: its place is gone, and it is never sent.
    await gate.until(lambda: admission.queued == 0)
    assert (await long).status_code == 200
    await gate.until(lambda: admission.active == 0)
    assert len(alive.seen) == 1
