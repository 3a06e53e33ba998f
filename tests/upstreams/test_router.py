"""slotgate in front of a stand-in llama-server in router mode (several models, one child
each), over real sockets: one line per model, each child never above its slots, unknown models
refused in the router's words, unloaded models loaded for their waiters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from slotgate.settings import Settings

from tests.conftest import CHAT, RunningGate, chat, serve
from tests.support.router import Hosted
from tests.support.standin import StandIn

MakeRouter = Callable[..., Any]


def hosted(slots: int = 2, state: str = "loaded", aliases: list[str] | None = None) -> Hosted:
    child = StandIn(total_slots=slots, tokens=3, token_delay_s=0.01)
    return Hosted(child, aliases or [], state)


@pytest.fixture
async def router() -> AsyncIterator[MakeRouter]:
    """Start a router stand-in serving the given models; it stops at the end."""
    started: list[StandIn] = []

    async def start(models: dict[str, Hosted], **knobs: Any) -> StandIn:
        upstream = StandIn(hosted=models, **knobs)
        await upstream.start()
        started.append(upstream)
        return upstream

    yield start
    for upstream in started:
        await upstream.stop()


@pytest.fixture
async def gate_before() -> AsyncIterator[Callable[..., Any]]:
    running: list[RunningGate] = []

    async def start(upstream: StandIn, **overrides: Any) -> RunningGate:
        values: dict[str, Any] = {
            "llama_server_url": upstream.url, "props_refresh_interval_s": 0.2,
            "keepalive_interval_s": 0, "log_level": "warning", "startup_wait_s": 10,
        }  # fmt: skip
        values.update(overrides)
        gate = await serve(Settings(_env_file=None, **values))
        running.append(gate)
        await gate.until(lambda: gate.service.models.routed and len(gate.service.models) > 0)
        return gate

    yield start
    for gate in running:
        await gate.stop()


def children(upstream: StandIn) -> dict[str, StandIn]:
    assert upstream.hosted is not None
    return {model: h.child for model, h in upstream.hosted.items()}


async def test_a_router_is_ready_and_shows_each_models_line(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(3, "unloaded", ["b"])})
    gate = await gate_before(upstream)
    await gate.until(lambda: gate.service.models.find("alpha").admission.capacity == 2)
    ready = await client.get(gate.url + "/readyz")
    assert ready.status_code == 200
    view = (await client.get(gate.url + "/admission")).json()
    models = {m["model"]: m for m in view["models"]}
    assert models["alpha"]["state"] == "loaded"
    assert models["alpha"]["capacity"] == 2
    assert models["alpha"]["pools"][0]["model"] == "alpha"
    assert models["beta"]["state"] == "unloaded"
    assert models["beta"]["aliases"] == ["b"]
    assert models["beta"]["capacity"] is None


async def test_each_childs_requests_never_exceed_its_slots(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(1)})
    gate = await gate_before(upstream)
    lanes = gate.service.models
    await gate.until(lambda: all(lane.admission.capacity is not None for lane in lanes))
    sent = [client.post(gate.url + CHAT, json=chat(model=model)) for model in ("alpha", "beta") * 6]
    answers = await asyncio.gather(*sent)
    assert [a.status_code for a in answers] == [200] * 12
    kids = children(upstream)
    assert kids["alpha"].max_running == 2
    assert kids["beta"].max_running == 1
    assert kids["alpha"].finished == kids["beta"].finished == 6


async def test_an_unknown_model_is_refused_at_once_in_the_routers_words(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2)})
    gate = await gate_before(upstream)
    answer = await client.post(gate.url + CHAT, json=chat(model="gamma"))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["message"] == "model 'gamma' not found"
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "model"
    missing = await client.post(gate.url + CHAT, json=chat())
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == "model name is missing from the request"
    assert children(upstream)["alpha"].started == 0


async def test_an_alias_finds_its_models_line(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, aliases=["a1"])})
    gate = await gate_before(upstream)
    await gate.until(lambda: gate.service.models.find("a1") is not None)
    answer = await client.post(gate.url + CHAT, json=chat(model="a1"))
    assert answer.status_code == 200
    assert children(upstream)["alpha"].finished == 1


async def test_a_request_for_an_unloaded_model_waits_while_it_loads_and_is_served(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, load_delay_s=0.3)
    gate = await gate_before(upstream)
    answers = await asyncio.gather(
        *(client.post(gate.url + CHAT, json=chat(model="alpha")) for _ in range(5))
    )
    assert [a.status_code for a in answers] == [200] * 5
    assert upstream.routing is not None
    assert upstream.routing.loads == 1
    assert children(upstream)["alpha"].max_running == 2


async def test_a_stream_waiting_for_its_model_hears_its_place(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, load_delay_s=1.5)
    gate = await gate_before(upstream, keepalive_interval_s=0.2, stream_head_after_s=0)
    body = chat(stream=True, model="alpha")
    async with client.stream("POST", gate.url + CHAT, json=body) as response:
        assert response.status_code == 200
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    assert b": queued position=1" in raw
    assert raw.rstrip().endswith(b"data: [DONE]")


async def test_autoload_false_refuses_an_unloaded_model_as_the_router_does(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded"), "beta": hosted(2)})
    gate = await gate_before(upstream)
    await gate.until(lambda: gate.service.models.find("beta").running)
    answer = await client.post(gate.url + CHAT + "?autoload=false", json=chat(model="alpha"))
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "model is not loaded"
    loaded = await client.post(gate.url + CHAT + "?autoload=false", json=chat(model="beta"))
    assert loaded.status_code == 200
    assert upstream.routing is not None
    assert upstream.routing.loads == 0


async def test_a_router_that_does_not_autoload_is_followed(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, models_autoload=False)
    gate = await gate_before(upstream)
    await gate.until(lambda: not gate.service.models.find("alpha").autoload)
    answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
    assert answer.status_code == 400
    assert answer.json()["error"]["message"] == "model is not loaded"


async def test_metrics_carry_each_childs_series_with_its_model(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(2), "gamma": hosted(2, "unloaded")})
    gate = await gate_before(upstream)
    await gate.until(lambda: len(gate.service.models) == 3)
    text = (await client.get(gate.url + "/metrics?source=llama-server")).text
    assert f'llamacpp:requests_processing{{upstream="{upstream.url}",model="alpha"}} 0' in text
    assert 'model="beta"' in text
    assert 'model="gamma"' not in text
    assert text.count("# TYPE llamacpp:requests_processing gauge") == 1


async def test_a_model_whose_load_failed_shows_its_exit_code(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    broken = hosted(2, "unloaded")
    broken.fails_with = 1
    upstream = await router({"alpha": broken}, load_delay_s=0.05)
    gate = await gate_before(upstream, startup_wait_s=1)
    answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
    assert answer.status_code == 503
    assert upstream.routing is not None
    assert upstream.hosted is not None
    assert upstream.hosted["alpha"].state == "failed"
    view = (await client.get(gate.url + "/admission")).json()
    (alpha,) = view["models"]
    assert alpha["state"] == "failed"
    assert alpha["exit_codes"] == {upstream.url: 1}


async def test_a_full_router_swaps_whole_lines_and_cuts_no_request(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    upstream = await router(
        {"alpha": hosted(2), "beta": hosted(2, "unloaded")}, models_max=1, load_delay_s=0.1
    )
    gate = await gate_before(upstream, model_swap_after_s=0.5)
    await gate.until(lambda: gate.service.models.find("alpha").running)
    sent = [client.post(gate.url + CHAT, json=chat(model=m)) for m in ("alpha", "beta") * 10]
    answers = await asyncio.gather(*sent)
    assert [a.status_code for a in answers] == [200] * 20
    routing = upstream.routing
    assert routing is not None
    kids = children(upstream)
    # One swap for the whole of beta's line, made by emptying alpha, never by cutting it.
    assert routing.loads == 1
    assert routing.evictions == 0
    assert routing.peak_loaded == 1
    assert kids["alpha"].cancelled == kids["beta"].cancelled == 0
    assert kids["alpha"].max_running == kids["beta"].max_running == 2


async def test_a_busy_model_is_emptied_for_a_line_that_waited_its_bound(
    router: MakeRouter, gate_before: Callable[..., Any], client: httpx.AsyncClient
) -> None:
    alpha = hosted(1)
    alpha.child.tokens = 40  # each alpha request holds its slot about 0.4 s
    upstream = await router({"alpha": alpha, "beta": hosted(1, "unloaded")}, models_max=1)
    gate = await gate_before(upstream, model_swap_after_s=0.3)
    lanes = gate.service.models
    await gate.until(lambda: lanes.find("alpha").running)
    # alpha's line never empties while beta waits: a steady stream of alpha requests.
    stop = asyncio.Event()

    async def alpha_stream() -> list[int]:
        codes = []
        while not stop.is_set():
            answer = await client.post(gate.url + CHAT, json=chat(model="alpha"))
            codes.append(answer.status_code)
        return codes

    feeders = [asyncio.create_task(alpha_stream()) for _ in range(3)]
    await gate.until(lambda: lanes.find("alpha").admission.queued > 0)
    beta = await client.post(gate.url + CHAT, json=chat(model="beta"))
    stop.set()
    codes = [code for feeder in await asyncio.gather(*feeders) for code in feeder]
    assert beta.status_code == 200
    assert set(codes) == {200}
    kids = children(upstream)
    assert kids["alpha"].cancelled == 0
    assert upstream.routing is not None
    assert upstream.routing.evictions == 0
