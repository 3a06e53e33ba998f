"""Shared fixtures: a stand-in llama-server and slotgate served by uvicorn on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn
from hypothesis import settings as hypothesis_settings
from slotgate.cli import uvicorn_config
from slotgate.gate import admission as admission_module
from slotgate.gate.models import Lane
from slotgate.main import Gateway, Service, create_app
from slotgate.proxy import protocol as protocol_module
from slotgate.settings import Settings
from slotgate.upstreams import upstream as upstream_module

from tests.support.hostile import CHAT_STREAM, Answer, Hostile, held, stream
from tests.support.router import Hosted, children, hosted
from tests.support.standin import StandIn
from tests.support.valkey import Valkey

#: For tests that make slotgate choose its local engine (--model, --demo): it is chosen before
#: the model, so without one they see "no llama.cpp engine" instead of what they test.
needs_engine = pytest.mark.skipif(
    importlib.util.find_spec("xllamacpp") is None
    and shutil.which("llama-server") is None
    and not os.environ.get("LLAMA_SERVER_BIN"),
    reason="no llama.cpp engine: install the demo extra (xllamacpp) or put llama-server on PATH",
)

#: The suite runs against a compiled build too (scripts/check): there, the tests that replace a
#: module's function or import (marked `interpreted`) would see the replacement ignored, as
#: compiled code calls what it was built with.
COMPILED = not admission_module.__file__ or not admission_module.__file__.endswith(".py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if COMPILED:
        skip = pytest.mark.skip(reason="replaces what a compiled build binds when it is built")
        for item in items:
            if item.get_closest_marker("interpreted"):
                item.add_marker(skip)
    # The Docker replay (minutes: an install and a compile) first, so that when scripts/check
    # runs the slower tiers in two workers, the other tests run beside it, not after it.
    items.sort(key=lambda item: item.get_closest_marker("docker") is None)


# Property tests: a light run in the fast tier, the full count in scripts/check, which selects
# the profile with --hypothesis-profile=full.
hypothesis_settings.register_profile("fast", max_examples=60)
hypothesis_settings.register_profile("full", max_examples=300)
hypothesis_settings.load_profile("fast")


@pytest.fixture(autouse=True)
def quick_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    """slotgate's fixed pauses, shortened for tests: no test waits on them for what it asserts,
    but each costs a test that meets it up to a second (the upstream's retry while llama-server
    is not ready, the linger before closing a connection that was answered an error, the sweep
    that finds slow heads and clients gone from a paused socket)."""
    monkeypatch.setattr(upstream_module, "NOT_READY_RETRY_S", 0.1)
    monkeypatch.setattr(protocol_module, "LINGER_S", 0.05)
    monkeypatch.setattr(protocol_module, "SWEEP_S", 0.1)


class Server(uvicorn.Server):
    """uvicorn's server, stopped without its fixed pauses.

    uvicorn's own main loop checks `should_exit` every 0.1 s, and its shutdown sleeps 0.1 s
    before it waits for connections and tasks in 0.1 s steps: together about 0.15 s at the end
    of every test that starts slotgate. This one wakes at once and polls every 5 ms; what it
    waits for, and in which order, is uvicorn's.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.stopping = asyncio.Event()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self.stopping.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while self.server_state.connections or self.server_state.tasks:
                    await asyncio.sleep(0.005)
                for server in self.servers:
                    await server.wait_closed()
        except TimeoutError:
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        await self.lifespan.shutdown()

    def stop(self) -> None:
        self.should_exit = True
        self.stopping.set()


class RunningGate:
    """slotgate listening on 127.0.0.1 at an ephemeral port, inside the test's event loop."""

    def __init__(self, app: Gateway, server: Server, task: asyncio.Task[None]) -> None:
        self.app = app
        self.server = server
        self.task = task
        sockets = server.servers[0].sockets
        self.port = sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def service(self) -> Service:
        service: Service = self.app.state.service
        return service

    async def stop(self) -> None:
        self.server.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, timeout=60)

    async def until(self, check: Callable[[], bool]) -> None:
        """Wait until `check()` holds; bounded generously (30 s), as a loaded machine can be slow
        to get there, and a check that holds returns at once."""
        async with asyncio.timeout(30.0):
            while not check():
                await asyncio.sleep(0.01)


async def serve(settings: Settings, app: Gateway | None = None) -> RunningGate:
    app = app or create_app(settings)
    # uvicorn as `slotgate` runs it, on a free port, and quicker to give up on a drain.
    config = uvicorn_config(app, settings.model_copy(update={"host": "127.0.0.1", "port": 0}))
    config.timeout_graceful_shutdown = 0.5  # type: ignore[assignment]  # Server takes a float
    server = Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    return RunningGate(app, server, task)


class Upstream(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


Started = TypeVar("Started", bound=Upstream)


@contextlib.asynccontextmanager
async def kept_running(upstream: Started) -> AsyncIterator[Started]:
    """The upstream started, and stopped at the end."""
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.stop()


@pytest.fixture
async def standin() -> AsyncIterator[StandIn]:
    """A stand-in llama-server (tests/support/standin.py)."""
    async with kept_running(StandIn()) as upstream:
        yield upstream


StartUpstreams = Callable[..., Awaitable[None]]


@pytest.fixture
async def start_upstreams() -> AsyncIterator[StartUpstreams]:
    """Start the given stand-ins (more llama-servers than the one `standin` gives); each is
    stopped at the test's end, before the slotgates a fixture requested earlier stops."""
    running: list[StandIn] = []

    async def start(*upstreams: StandIn) -> None:
        for upstream in upstreams:
            await upstream.start()
            running.append(upstream)

    yield start
    for upstream in running:
        await upstream.stop()


@pytest.fixture
def quiet_upstreams() -> None:
    """Every llama-server is known to add no `__verbose` unasked, so a non-streamed request is
    assembled from the first (without it, the first answer of each upstream goes as sent):
    `start_gate` tells each fleet it starts so (`Fleet.known_quiet`)."""


#: Three tenants by key: two without limits, one with two places of its own in the line.
TENANTS = """
[tenants.flood]
key = "sk-flood"

[tenants.chat]
key = "sk-chat"

[tenants.jobs]
key = "sk-jobs"
max_queued = 2
"""


def write_keys(directory: Path, text: str) -> Path:
    """An API_KEYS_FILE in `directory` that says `text`."""
    path = directory / "keys.toml"
    path.write_text(text)
    return path


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    """An API_KEYS_FILE of TENANTS."""
    return write_keys(tmp_path, TENANTS)


@pytest.fixture
def valkey() -> Iterator[Valkey]:
    """A valkey-server of its own on a loopback port, killed at the end."""
    server = Valkey()
    server.start()
    try:
        yield server
    finally:
        server.resume_if_paused()
        server.kill()


@pytest.fixture
async def hostile() -> AsyncIterator[Hostile]:
    """An upstream that misbehaves as the test scripts it (tests/support/hostile.py)."""
    async with kept_running(Hostile()) as upstream:
        yield upstream


async def before_hostile(
    start_gate: GateFactory, hostile: Hostile, **overrides: Any
) -> RunningGate:
    """slotgate before the hostile upstream. It reads /props once, at the start: a poll in the
    middle of a test would take pooled connections the test is watching."""
    values: dict[str, Any] = {"props_refresh_interval_s": 60, **overrides}
    gate: RunningGate = await start_gate(llama_server_url=hostile.url, **values)
    return gate


async def waiting_before_hostile(start_gate: GateFactory, hostile: Hostile) -> RunningGate:
    """`before_hostile`, giving a stream that waits slotgate's head at once and a keep-alive
    comment each second."""
    return await before_hostile(start_gate, hostile, keepalive_interval_s=1, stream_head_after_s=0)


async def read_stream(client: httpx.AsyncClient, url: str) -> bytes:
    async with client.stream("POST", url, json=chat(stream=True)) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_raw()])


async def answered_after_waiting(
    gate: RunningGate, hostile: Hostile, client: httpx.AsyncClient, answer: Answer
) -> bytes:
    """What a stream gets that waited in line, its 200 head already out (STREAM_HEAD_AFTER_S=0),
    while a stream held the only slot, and that llama-server then answers with `answer`."""
    release = asyncio.Event()
    hostile.script.append(held(release, stream(*CHAT_STREAM)))
    holder = asyncio.create_task(read_stream(client, gate.url + CHAT))
    await gate.until(lambda: len(hostile.served()) == 1)
    waiter = asyncio.create_task(read_stream(client, gate.url + CHAT))
    await gate.until(lambda: gate.service.admission.queued == 1)
    hostile.script.append(answer)
    release.set()
    await holder
    return await waiter


@pytest.fixture
async def redis(valkey: Valkey) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's valkey-server."""
    client = aioredis.Redis.from_url(valkey.url, socket_timeout=5, socket_connect_timeout=5)
    yield client
    await client.aclose()


@pytest.fixture
async def served() -> AsyncIterator[list[RunningGate]]:
    """The slotgates a test serves (it appends them); stopped at its end."""
    running: list[RunningGate] = []
    yield running
    for gate in running:
        await gate.stop()


def replica_view(gate: RunningGate) -> dict[str, Any]:
    """What a slotgate sharing a Redis line has heard of the fleet and holds itself."""
    replica = gate.service.gate
    heard: dict[str, Any] = replica.view()
    return heard


def probed(gate: RunningGate, upstreams: int = 1) -> Callable[[], bool]:
    """`gate` has read the slots of its `upstreams` itself: a replica that knows the fleet's
    slots only from Redis still refuses a request it cannot weigh (503)."""
    return lambda: sum(1 for pool in gate.service.admission.pools if pool.capacity) >= upstreams


GateFactory = Callable[..., Any]


@pytest.fixture
async def start_gate(
    standin: StandIn, request: pytest.FixtureRequest
) -> AsyncIterator[GateFactory]:
    """Start slotgate in front of the stand-in with the given settings; waits until ready.
    With `quiet_upstreams`, its upstreams are known to add no `__verbose` from the start."""
    running: list[RunningGate] = []
    quiet = "quiet_upstreams" in request.fixturenames

    async def start(*, ready: bool = True, **overrides: Any) -> RunningGate:
        values: dict[str, Any] = {
            "llama_server_url": standin.url, "props_refresh_interval_s": 0.2,
            "keepalive_interval_s": 0, "log_level": "warning",
        }  # fmt: skip
        values.update(overrides)
        gate = await serve(Settings(_env_file=None, **values))
        running.append(gate)
        # Before any request: the first one is assembled or not by what the fleet knows.
        gate.service.fleet.known_quiet = quiet
        if ready:
            await gate.until(lambda: gate.service.upstream.ready)
        return gate

    yield start
    for gate in running:
        await gate.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30, limits=limits) as c:
        yield c


CHAT = "/v1/chat/completions"


def assert_lines(text: str, *lines: str) -> None:
    """Each of `lines` stands in `text` (a /metrics exposition, say); all that do not, named."""
    missing = [line for line in lines if line not in text]
    assert not missing, missing


async def error_answered(
    client: httpx.AsyncClient, gate: RunningGate, status: int, **body: Any
) -> dict[str, Any]:
    """The error of a chat answered with `status`, its slot already given back."""
    response = await client.post(gate.url + CHAT, json=chat(**body))
    assert response.status_code == status
    assert gate.service.admission.active == 0
    error: dict[str, Any] = response.json()["error"]
    return error


def assert_not_ready(response: httpx.Response) -> None:
    """A 503 saying llama-server is not ready yet, to be asked again in a second."""
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "upstream_not_ready"


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait until each has ended, however it ends."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}


def words(n: int, **extra: Any) -> dict[str, Any]:
    """A chat whose prompt a counting stand-in weighs as `n` tokens."""
    return chat(messages=[{"role": "user", "content": "w " * n}], **extra)


def counting(standin: StandIn) -> StandIn:
    """The stand-in with four slots, counting prompts (/apply-template, /tokenize) as
    llama-server does, one token a word: for the KV-budget tests."""
    standin.counts, standin.total_slots, standin.tokens = True, 4, 20
    return standin


async def hold_stream_of(
    client: httpx.AsyncClient,
    gate: RunningGate,
    body: dict[str, Any],
    started: asyncio.Event,
    headers: dict[str, str] | None = None,
) -> list[bytes]:
    """Open a stream, signal once its first chunk arrived, then read it to the end."""
    chunks: list[bytes] = []
    async with client.stream("POST", gate.url + CHAT, json=body, headers=headers) as response:
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
            started.set()
    return chunks


async def occupy(client: httpx.AsyncClient, gate: RunningGate) -> asyncio.Task[list[bytes]]:
    """Hold a slot with a stream; returns once its first chunk has arrived."""
    started = asyncio.Event()
    holder = asyncio.create_task(hold_stream_of(client, gate, chat(stream=True), started))
    await started.wait()
    return holder


@pytest.fixture
def one_slot(start_gate: GateFactory, standin: StandIn) -> GateFactory:
    """Start slotgate with the given settings before a one-slot stand-in whose generations are
    `tokens` tokens of 0.05 s each (until the test calls `standin.hurry()`): by default they
    run until hurried, however slow the machine is at getting the test to what it looks at."""

    async def start(tokens: int = 1000, **settings: Any) -> RunningGate:
        standin.tokens, standin.token_delay_s = tokens, 0.05
        standin.total_slots = 1
        gate: RunningGate = await start_gate(**settings)
        return gate

    return start


@pytest.fixture
def loading_gate(start_gate: GateFactory, standin: StandIn) -> GateFactory:
    """Start slotgate with the given settings before a stand-in still loading its model, so
    that the capacity is not known yet (until the test sets `standin.loading = False`)."""

    async def start(**settings: Any) -> RunningGate:
        standin.loading = True
        gate: RunningGate = await start_gate(ready=False, **settings)
        return gate

    return start


@pytest.fixture
async def one_slot_held(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> AsyncIterator[GateFactory]:
    """`one_slot`, with that slot held by a stream: the set-up of every test of what a request
    meets while it waits. At the test's end the stream is hurried and must end well."""
    holders: list[asyncio.Task[list[bytes]]] = []

    async def start(tokens: int = 1000, **settings: Any) -> RunningGate:
        gate: RunningGate = await one_slot(tokens, **settings)
        holders.append(await occupy(client, gate))
        return gate

    yield start
    standin.hurry()
    for holder in holders:
        await holder


def line(gate: RunningGate, model: str) -> Lane:
    """The line of `model` (the router has listed it: `gate_before` waits for that)."""
    found = gate.service.models.find(model)
    assert found is not None
    return found


MakeRouter = Callable[..., Awaitable[StandIn]]


async def slow_model(router: MakeRouter) -> tuple[StandIn, StandIn]:
    """A router stand-in serving one model, "alpha", of one slot, whose answers run long (1000
    tokens of 0.05 s, until its child is hurried): the router and that child."""
    upstream = await router({"alpha": hosted(1)})
    child = children(upstream)["alpha"]
    child.tokens, child.token_delay_s = 1000, 0.05
    return upstream, child


GatesFor = Callable[..., Awaitable[RunningGate]]


@pytest.fixture
def router(start_upstreams: StartUpstreams) -> MakeRouter:
    """Start a stand-in llama-server router serving the given models (tests/support/router.py);
    it stops at the end."""

    async def start(models: dict[str, Hosted], **knobs: Any) -> StandIn:
        upstream = StandIn(hosted=models, **knobs)
        await start_upstreams(upstream)
        return upstream

    return start


@pytest.fixture
def gates_for(served: list[RunningGate]) -> GatesFor:
    """slotgate in front of the given upstreams (one, or a fleet); stopped at the end."""

    async def start(upstreams: list[StandIn], **overrides: Any) -> RunningGate:
        values: dict[str, Any] = {
            "llama_server_url": ",".join(u.url for u in upstreams),
            "props_refresh_interval_s": 0.2, "keepalive_interval_s": 0, "log_level": "warning",
        }  # fmt: skip
        values.update(overrides)
        gate = await serve(Settings(_env_file=None, **values))
        served.append(gate)
        return gate

    return start


@pytest.fixture
def gate_before(gates_for: GatesFor) -> GatesFor:
    """slotgate in front of one router, once it has followed the router's models."""

    async def start(upstream: StandIn, **overrides: Any) -> RunningGate:
        gate = await gates_for([upstream], **{"startup_wait_s": 10, **overrides})
        lanes = gate.service.models
        # Every model listed, and the slots of every loaded one known.
        await gate.until(
            lambda: (
                lanes.routed
                and len(lanes) > 0
                and all(lane.running for lane in lanes if lane.state == "loaded")
            )
        )
        return gate

    return start
