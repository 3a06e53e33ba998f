"""slotgate in front of a real router-mode llama-server: one line per model, each child given
no more than its own slots, models that are not loaded waited for, unknown models refused at
once, and a model swap that never cuts a running request.

Two routers serve the demo's gemma under two ids, `alpha` and `beta` (2 slots each, 1 thread):
one that keeps both loaded (`--models-max 2`), and one that must swap (`--models-max 1`). Each
starts once for this module; every test serves its own slotgate in front of one of them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from slotgate.settings import Settings

from tests.conftest import RunningGate, serve
from tests.e2e.conftest import eventually
from tests.support.real_router import Router, RouterView, chat, models_dir

pytestmark = pytest.mark.e2e

MODELS = ("alpha", "beta")
SLOTS = 2
#: llama.cpp's /metrics posts a task to the child's queue; polling faster disturbs it.
POLL_S = 0.5


def router(factory: pytest.TempPathFactory, models_max: int) -> Router:
    """A router over both models, its models folder and log in a temporary folder of its own."""
    tmp = factory.mktemp(f"router-{models_max}")
    return Router(models_dir(tmp / "models", MODELS), tmp / "router.log", models_max=models_max)


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """A router that can keep both models loaded."""
    with router(tmp_path_factory, models_max=2) as started:
        yield started


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    """A router that holds one model at a time: another model's request makes it swap."""
    with router(tmp_path_factory, models_max=1) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=180, limits=limits) as c:
        yield c


async def gate_for(router: Router, client: httpx.AsyncClient, **overrides: Any) -> RunningGate:
    """slotgate in front of `router`, once its /readyz says it is ready."""
    values: dict[str, Any] = {
        "llama_server_url": router.url,
        "keepalive_interval_s": 0,
        "startup_wait_s": 120,
        "log_level": "warning",
    }
    values.update(overrides)
    gate = await serve(Settings(_env_file=None, **values))

    async def ready() -> bool:
        return (await client.get(gate.url + "/readyz")).status_code == 200

    try:
        await eventually(ready, timeout_s=30, every_s=0.1)
    except TimeoutError:
        await gate.stop()
        pytest.fail(f"slotgate in front of the router never became ready:\n{router.tail(1500)}")
    return gate


@pytest.fixture
async def gates(client: httpx.AsyncClient) -> AsyncIterator[list[RunningGate]]:
    running: list[RunningGate] = []
    yield running
    for gate in running:
        await gate.stop()


@dataclass
class Watch:
    """Each child's `llamacpp:*` gauges as the router shows them, read every POLL_S seconds."""

    view: RouterView
    max_deferred: dict[str, float] = field(default_factory=dict)
    max_processing: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    async def run(self) -> None:
        while True:
            for model in MODELS:
                metrics = await self.view.metrics(model)
                if metrics is None:
                    continue
                self.samples[model] = self.samples.get(model, 0) + 1
                deferred = metrics["requests_deferred"]
                processing = metrics["requests_processing"]
                self.max_deferred[model] = max(self.max_deferred.get(model, 0.0), deferred)
                self.max_processing[model] = max(self.max_processing.get(model, 0.0), processing)
            await asyncio.sleep(POLL_S)


async def watched(view: RouterView, *requests: Any) -> tuple[Watch, list[Any]]:
    """Run `requests` together while a Watch reads the children."""
    watch = Watch(view)
    task = asyncio.create_task(watch.run())
    try:
        answers = await asyncio.gather(*requests)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return watch, answers


async def loaded(view: RouterView, *models: str) -> None:
    """Load `models` on the router (a one-token request each) and wait until they are."""
    for model in models:
        answer = await view.chat(model, 1)
        assert answer.status_code == 200, answer.text


async def processing(view: RouterView, model: str, count: int) -> None:
    """Wait until `model`'s child runs `count` requests."""

    async def check() -> bool:
        metrics = await view.metrics(model)
        return metrics is not None and metrics["requests_processing"] == count

    await eventually(check, timeout_s=60, every_s=POLL_S)


@dataclass
class Stream:
    """One streamed chat completion, read to its end or until cancelled."""

    status: int = 0
    comments: int = 0
    comments_before_data: int = 0
    tokens: int = 0
    finish: str | None = None
    done: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], into: Stream) -> Stream:
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        into.status = response.status_code
        async for line in response.aiter_lines():
            if line.startswith(":"):
                into.comments += 1
            elif line == "data: [DONE]":
                into.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if into.tokens == 0 and not into.started.is_set():
                    into.comments_before_data = into.comments
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        into.tokens += 1
                        into.started.set()
                    into.finish = choice.get("finish_reason") or into.finish
    return into


def streamed(model: str, max_tokens: int) -> dict[str, Any]:
    return chat(model, max_tokens, stream=True)


# -- per-model slots --------------------------------------------------------------------------


async def test_straight_to_the_router_three_times_the_slots_wait_inside_each_child(
    both: Router, client: httpx.AsyncClient
) -> None:
    """The control: what the gate prevents below does happen without it, and the Watch sees it."""
    view = RouterView(both.url, client)
    await loaded(view, *MODELS)
    # Not necessarily in both children (seen: 2 deferred in one, 0 in the other), nor in every
    # burst: part of a burst can wait inside the router itself, unseen by any child's metrics,
    # and on a loaded machine the router may forward one slowly enough that none does. Up to
    # three bursts, then: the control shows that it happens, and that the Watch sees it.
    seen = []
    for _ in range(3):
        watch, answers = await watched(
            view, *(view.chat(model, 32) for model in MODELS for _ in range(3 * SLOTS))
        )
        assert [a.status_code for a in answers] == [200] * 6 * SLOTS
        seen.append(watch)
        if max(watch.max_deferred.values()) > 0:
            break
    assert max(watch.max_deferred.values()) > 0, seen


async def test_three_times_each_models_slots_through_slotgate_never_wait_inside_a_child(
    both: Router, client: httpx.AsyncClient, gates: list[RunningGate]
) -> None:
    view = RouterView(both.url, client)
    await loaded(view, *MODELS)
    # A line long enough for all of them: every request is answered, none inside a child.
    gate = await gate_for(both, client, max_queue=3 * SLOTS)
    gates.append(gate)
    url = gate.url + "/v1/chat/completions"
    watch, answers = await watched(
        view,
        *(client.post(url, json=chat(model, 32)) for model in MODELS for _ in range(3 * SLOTS)),
    )
    assert [a.status_code for a in answers] == [200] * 6 * SLOTS
    assert {a.json()["model"] for a in answers} == set(MODELS)
    assert watch.max_deferred == dict.fromkeys(MODELS, 0.0), watch
    # Both children were seen at work, each on at most its own slots.
    assert all(watch.samples.get(model, 0) > 0 for model in MODELS), watch
    assert all(0 < watch.max_processing[model] <= SLOTS for model in MODELS), watch


async def test_each_models_line_is_bounded_and_refuses_with_retry_after_once_full(
    both: Router, client: httpx.AsyncClient, gates: list[RunningGate]
) -> None:
    view = RouterView(both.url, client)
    await loaded(view, *MODELS)
    gate = await gate_for(both, client, max_queue=1)
    gates.append(gate)
    # Every slot of both models busy with a long stream, seen busy by the children themselves.
    holders = [
        asyncio.create_task(stream(client, gate.url, streamed(model, 1000), Stream()))
        for model in MODELS
        for _ in range(SLOTS)
    ]
    more: list[asyncio.Task[httpx.Response]] = []
    try:
        for model in MODELS:
            await processing(view, model, SLOTS)
        # Then 4 more per model: one takes the model's single place in line, 3 are refused.
        more = [
            asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat(m, 4)))
            for m in MODELS
            for _ in range(4)
        ]
        await eventually(lambda: sum(t.done() for t in more) >= 3 * len(MODELS), timeout_s=60)
        refused = [t.result() for t in more if t.done()]
        waiters = [t for t in more if not t.done()]
        assert len(refused) == 3 * len(MODELS), [r.status_code for r in refused]
        for answer in refused:
            assert answer.status_code in (429, 503), answer.text
            assert int(answer.headers["retry-after"]) >= 1
        assert sorted(sent_model(a) for a in refused) == sorted(
            [m for m in MODELS for _ in range(3)]
        )
        # The children never held more than their slots meanwhile.
        for model in MODELS:
            metrics = await view.metrics(model)
            assert metrics is not None
            assert metrics["requests_deferred"] == 0, metrics
        # With the holders gone (their clients leave), each model's one waiter is served.
        for task in holders:
            task.cancel()
        served = await asyncio.gather(*waiters)
        assert [a.status_code for a in served] == [200] * len(MODELS)
        assert sorted(sent_model(a) for a in served) == sorted(MODELS)
    finally:
        for each in [*holders, *more]:
            each.cancel()
        await asyncio.gather(*holders, *more, return_exceptions=True)


def sent_model(answer: httpx.Response) -> str:
    model: str = json.loads(answer.request.content)["model"]
    return model


# -- models that are not loaded, and models that do not exist ---------------------------------


async def test_a_request_for_an_unloaded_model_waits_for_its_load_and_is_served(
    both: Router, client: httpx.AsyncClient, gates: list[RunningGate]
) -> None:
    view = RouterView(both.url, client)
    await loaded(view, *MODELS)
    await view.unload("beta")

    async def unloaded() -> bool:
        return (await view.states())["beta"] == "unloaded"

    await eventually(unloaded, timeout_s=60, every_s=POLL_S)
    loads = both.loads().count("beta")
    gate = await gate_for(both, client, keepalive_interval_s=0.2, stream_head_after_s=0)
    gates.append(gate)
    answer = await stream(client, gate.url, streamed("beta", 8), Stream())
    assert (answer.status, answer.tokens, answer.finish, answer.done) == (200, 8, "length", True)
    assert both.loads().count("beta") == loads + 1
    assert (await view.states())["beta"] == "loaded"
    # It waited in its line while the model loaded, told so as a waiting stream is.
    assert answer.comments_before_data > 0, answer


async def test_an_unknown_model_is_refused_at_once_as_the_router_refuses_it(
    both: Router, client: httpx.AsyncClient, gates: list[RunningGate]
) -> None:
    view = RouterView(both.url, client)
    direct = await view.chat("no-such-model", 4)
    assert direct.status_code == 400, direct.text  # the router's own answer, as this build has it
    loads = both.loads()
    # Waiting would take minutes: a model slotgate waited for would be a 503 after 120 s.
    gate = await gate_for(both, client, startup_wait_s=120, queue_timeout_s=120)
    gates.append(gate)
    async with asyncio.timeout(30):
        refused = await client.post(
            gate.url + "/v1/chat/completions", json=chat("no-such-model", 4)
        )
    assert refused.status_code == direct.status_code, refused.text
    error = refused.json()["error"]
    assert error["type"] == direct.json()["error"]["type"]
    assert "no-such-model" in error["message"]
    assert both.loads() == loads


# -- swaps under --models-max 1 ---------------------------------------------------------------


async def test_a_swap_waits_for_the_running_request_and_never_cuts_it(
    single: Router, client: httpx.AsyncClient, gates: list[RunningGate]
) -> None:
    view = RouterView(single.url, client)
    await loaded(view, "alpha")
    gate = await gate_for(single, client)
    gates.append(gate)
    running = Stream()
    first = asyncio.create_task(stream(client, gate.url, streamed("alpha", 96), running))
    async with asyncio.timeout(60):
        await running.started.wait()
    # Another model's requests while alpha generates: beta can load only once alpha is idle.
    others = [
        asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat("beta", 4)))
        for _ in range(SLOTS)
    ]
    answer = await first
    assert (answer.status, answer.tokens, answer.finish, answer.done) == (200, 96, "length", True)
    assert [a.status_code for a in await asyncio.gather(*others)] == [200] * SLOTS
    assert single.loads()[-1] == "beta"
    assert "exited with status 0" in single.text()


async def test_an_alternating_burst_under_one_model_at_a_time_loads_no_more_than_the_router_would(
    single: Router, client: httpx.AsyncClient, gates: list[RunningGate]
) -> None:
    view = RouterView(single.url, client)
    await loaded(view, "alpha")
    gate = await gate_for(single, client, max_queue=0)
    gates.append(gate)
    before = len(single.loads())
    url = gate.url + "/v1/chat/completions"
    answers = await asyncio.gather(
        *(client.post(url, json=chat(MODELS[n % 2], 8)) for n in range(4 * SLOTS))
    )
    assert [a.status_code for a in answers] == [200] * 4 * SLOTS
    # alpha is loaded: its requests first, then one swap to beta for all of beta's. The router
    # alone does the same (its scheduler serves what it holds before it evicts); a gate that
    # sent each model only what its slots take could make it swap back and forth.
    assert single.loads()[before:] == ["beta"]
