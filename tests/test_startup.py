"""No 503 while llama-server is merely starting or restarting: requests wait for it, bounded."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable

import httpx
import pytest
from slotgate.asgi import Header
from slotgate.upstreams.client import Response
from slotgate.upstreams.server import Requester

from bench.procs import free_port
from tests.conftest import CHAT, GateFactory, StartUpstreams, assert_not_ready, chat
from tests.support.harness import PassingClient
from tests.support.standin import StandIn


async def test_a_request_that_arrives_while_llama_server_loads_waits_and_is_served(
    loading_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await loading_gate(
        props_refresh_interval_s=30, keepalive_interval_s=5, stream_head_after_s=0
    )
    plain = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert (await client.get(gate.url + "/readyz")).status_code == 503
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as streamed:
        assert streamed.status_code == 200  # a waiting stream's head, at once
        chunks = streamed.aiter_raw()
        assert (await anext(chunks)).startswith(b": queued")
        standin.loading = False
        rest = b"".join([chunk async for chunk in chunks])
    answer = await plain
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"].startswith("t0")
    assert b"data: [DONE]" in rest
    assert b'"error"' not in rest
    assert (await client.get(gate.url + "/readyz")).status_code == 200


@pytest.mark.parametrize("startup_wait_s", [0, 0.3], ids=["no-startup-wait", "past-it"])
async def test_a_request_past_the_startup_wait_gets_503_not_ready_until_capacity_is_known(
    loading_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, startup_wait_s: float
) -> None:
    gate = await loading_gate(startup_wait_s=startup_wait_s)
    response = await client.post(gate.url + CHAT, json=chat())
    assert_not_ready(response)  # a 503 with Retry-After
    assert (await client.get(gate.url + "/readyz")).status_code == 503
    assert standin.seen == []
    standin.loading = False
    await gate.until(lambda: gate.service.upstream.ready)
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    assert (await client.get(gate.url + "/readyz")).status_code == 200


async def test_a_request_too_big_for_the_pool_that_came_is_refused_when_it_is_known(
    loading_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await loading_gate()
    asked = asyncio.create_task(client.post(gate.url + CHAT, json=chat(n=3)))
    await gate.until(lambda: gate.service.admission.queued == 1)
    standin.loading = False
    response = await asked
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"


async def restart(standin: StandIn, down_s: float, loading_s: float) -> int:
    """llama-server goes away, comes back loading its model, then serves. Returns how many
    generations it was running when it went (those are cut short, as a restart cuts them)."""
    cut = standin.running
    standin.shutdown_timeout_s = 0.05  # a restart kills what runs, as a process exit does
    await standin.stop()
    await asyncio.sleep(down_s)
    standin.loading = True
    await standin.start()
    await asyncio.sleep(loading_s)
    standin.loading = False
    return cut


# Slow: a race that shows in a few of a hundred restarts, so a hundred in a row (scripts/check
# runs it); test_a_trickle_of_requests_across_restarts_gets_no_503 restarts in the fast tier.
@pytest.mark.slow
async def test_a_client_that_waits_for_health_then_generates_is_served_100_times_in_a_row(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 2, 0.0
    # The default refresh interval: slotgate learns the slot count from the /health answer
    # it passes through, not from its timer.
    gate = await start_gate(props_refresh_interval_s=10)
    rng = random.Random(14)
    served = 0
    for _ in range(100):
        restarting = asyncio.create_task(
            restart(standin, rng.uniform(0, 0.03), rng.uniform(0, 0.05))
        )
        await asyncio.sleep(0.001)
        while True:
            try:
                health = await client.get(gate.url + "/health")
            except httpx.HTTPError:
                continue
            if health.status_code == 200 and restarting.done():
                break
            await asyncio.sleep(0.005)
        response = await client.post(gate.url + CHAT, json=chat())
        assert response.status_code == 200, response.text
        served += 1
        await restarting
    assert served == 100


async def test_a_trickle_of_requests_across_restarts_gets_no_503(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 2, 0.005
    # A line long enough for every request: on a loaded machine llama-server may be away
    # longer than the 64 that arrive in 0.64 s, and a full line's 429 is not the question.
    gate = await start_gate(props_refresh_interval_s=10, max_queue=150)
    statuses: list[int] = []
    failures: list[bytes] = []
    cut = 0

    async def one(stream: bool) -> None:
        async with client.stream("POST", gate.url + CHAT, json=chat(stream=stream)) as r:
            body = b"".join([c async for c in r.aiter_raw()])
        failed = r.status_code != 200 or b'"error"' in body
        statuses.append(599 if failed else 200)
        if failed:
            failures.append(body)

    async def trickle() -> None:
        tasks = []
        for i in range(150):
            tasks.append(asyncio.create_task(one(stream=i % 3 == 0)))
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)

    async def restarts() -> None:
        nonlocal cut
        for _ in range(3):
            await asyncio.sleep(0.3)
            cut += await restart(standin, 0.1, 0.2)

    await asyncio.gather(trickle(), restarts())
    assert len(statuses) == 150
    # Only the generations running when llama-server went away fail (it cut them); every
    # request that arrived while it was away or loading waited and was served.
    assert len(failures) <= cut, [body[:120] for body in failures]
    assert not [body for body in failures if b"upstream_not_ready" in body]


async def test_an_admitted_stream_that_finds_llama_server_restarting_waits_under_comments(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(
        props_refresh_interval_s=30, keepalive_interval_s=0.05, stream_head_after_s=0.2
    )
    standin.shutdown_timeout_s = 0.05
    await standin.stop()
    assert gate.service.upstream.ready  # slotgate has not noticed yet: the request is admitted
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as streamed:
        assert streamed.status_code == 200
        chunks = streamed.aiter_raw()
        assert (await anext(chunks)).startswith(b": queued")
        # It waits at the head of the line, for whichever upstream has room first.
        assert (gate.service.admission.active, gate.service.admission.queued) == (0, 1)
        assert gate.service.admission.pools[0].capacity is None
        standin.loading = True
        await standin.start()
        await asyncio.sleep(0.1)
        standin.loading = False
        rest = b"".join([chunk async for chunk in chunks])
    assert b"data: [DONE]" in rest
    assert b'"error"' not in rest


async def test_a_llama_server_url_nobody_listens_on_is_refused_at_once_naming_it_and_why(
    start_gate: GateFactory, client: httpx.AsyncClient, start_upstreams: StartUpstreams
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gate = await start_gate(ready=False, llama_server_url=url, startup_wait_s=60)
    await gate.until(lambda: "refused" in gate.service.fleet.reason.lower())
    for body in (chat(), chat(stream=True)):
        started = time.monotonic()
        response = await client.post(gate.url + CHAT, json=body)
        assert time.monotonic() - started < 10  # not STARTUP_WAIT_S's 60 s
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        message = response.json()["error"]["message"]
        assert url in message
        assert "refused" in message.lower()
    ready = await client.get(gate.url + "/readyz")
    assert ready.status_code == 503
    assert url in ready.json()["reason"]
    assert "refused" in ready.json()["reason"].lower()
    # It becomes ready as soon as llama-server comes up there.
    late = StandIn(port=port)
    await start_upstreams(late)
    async with asyncio.timeout(10):
        while (await client.get(gate.url + "/readyz")).status_code != 200:
            await asyncio.sleep(0.05)
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200


async def test_a_llama_server_that_was_up_and_went_away_is_still_waited_for(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(startup_wait_s=60)
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    await standin.stop()
    await gate.until(lambda: not gate.service.fleet.ready)
    waiting = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    await standin.start()  # on the port it had
    answer = await waiting
    assert answer.status_code == 200


class SlowProps(PassingClient):
    """Its /props reads time out once `served` is set: after llama-server answered a request
    meanwhile, as on a starved machine, where slotgate's own loop is what is late."""

    def __init__(self, client: Requester) -> None:
        super().__init__(client)
        self.served = asyncio.Event()

    async def request(
        self, method: str, target: str, headers: Iterable[Header], body: bytes
    ) -> Response:
        if target.endswith("/props"):
            await self.served.wait()
            raise TimeoutError
        return await self.client.request(method, target, headers, body)


async def test_a_props_read_that_times_out_while_llama_server_answers_requests_leaves_it_ready(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    # Read by hand below, not by the follower meanwhile.
    gate = await start_gate(props_refresh_interval_s=3600)
    upstream = gate.service.upstream
    upstream._client = slow = SlowProps(upstream._client)
    served = slow.served
    reading = asyncio.create_task(upstream.refresh())
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    served.set()
    await reading
    assert upstream.ready
    assert gate.service.admission.capacity is not None
    # A read that times out with nothing answered meanwhile still marks it down.
    served.clear()
    reading = asyncio.create_task(upstream.refresh())
    await asyncio.sleep(0)
    served.set()
    await reading
    assert not upstream.ready


async def test_restart_with_another_parallel_is_followed(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    start_upstreams: StartUpstreams,
) -> None:
    gate = await start_gate(startup_wait_s=0)  # 503 at once while away (tests/test_startup.py)
    await standin.stop()
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 503
    await gate.until(lambda: not gate.service.upstream.ready)
    assert (await client.get(gate.url + "/readyz")).status_code == 503
    restarted = StandIn(total_slots=3, port=standin.port, loading=True, shutdown_timeout_s=0.05)
    await start_upstreams(restarted)
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 503
    restarted.loading = False
    await gate.until(lambda: gate.service.admission.capacity == 3)
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
