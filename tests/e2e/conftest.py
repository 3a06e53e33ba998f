"""The real thing: llama.cpp's own server on the PyPI gemma model, slotgate in front of it.

One engine serves the whole session (2 slots, 2048 tokens of context, so 1024 per slot,
1 thread: on 2 cores more threads only fight the proxy and the client). slotgate runs in each
test's own event loop, as the rest of the suite runs it. Every test starts with llama.cpp idle,
so no test inherits another's generations.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from slotgate.engine.process import LocalEngine
from slotgate.settings import Settings

from tests.conftest import RunningGate, serve

#: llama.cpp's /slots and /metrics each post a task to its queue; polling them faster than
#: this keeps waking its waiting readers and starves its detection of clients that left.
POLL_S = 0.5
#: A prompt that gemma answers at length: with ignore_eos the length is max_tokens anyway.
PROMPT = "Count from one to one thousand, one number per line."


@pytest.fixture(scope="session")
def engine() -> Iterator[LocalEngine]:
    """The demo engine, started as `slotgate --demo --parallel 2 --ctx-size 2048` starts it."""
    local = LocalEngine.from_args(model=None, demo=True, parallel=2, ctx_size=2048, threads=1)
    local.start()
    yield local
    local.stop()


def chat(max_tokens: int, *, stream: bool, content: str = PROMPT, **extra: Any) -> dict[str, Any]:
    """A chat completion of exactly `max_tokens` tokens (llama.cpp's ignore_eos)."""
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
        **extra,
    }


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], timeout_s: float, every_s: float = 0.01
) -> float:
    """Wait until `check()` holds; return how long that took. TimeoutError if it never does."""
    started = time.monotonic()
    async with asyncio.timeout(timeout_s):
        while True:
            held = check()
            if not isinstance(held, bool):
                held = await held
            if held:
                return time.monotonic() - started
            await asyncio.sleep(every_s)


@dataclass
class Llama:
    """llama.cpp's own view, read straight from the engine, never through slotgate."""

    url: str
    client: httpx.AsyncClient

    async def slots(self) -> list[dict[str, Any]]:
        response = await self.client.get(self.url + "/slots")
        response.raise_for_status()
        slots: list[dict[str, Any]] = response.json()
        return slots

    async def busy_tasks(self) -> set[int]:
        """Task ids of the requests that hold a slot right now."""
        return {slot["id_task"] for slot in await self.slots() if slot["is_processing"]}

    async def metrics(self) -> dict[str, float]:
        response = await self.client.get(self.url + "/metrics")
        response.raise_for_status()
        found = re.findall(r"^llamacpp:(\w+) (\S+)$", response.text, flags=re.MULTILINE)
        return {name: float(value) for name, value in found}

    async def idle(self, timeout_s: float = 60.0) -> None:
        async with asyncio.timeout(timeout_s):
            while await self.busy_tasks():
                await asyncio.sleep(POLL_S)


@dataclass
class Watch:
    """What llama.cpp showed while a test ran, read every POLL_S seconds."""

    llama: Llama
    max_busy: int = 0
    max_deferred: float = 0.0
    max_processing: float = 0.0
    samples: int = 0
    busy_seen: list[set[int]] = field(default_factory=list)

    async def run(self) -> None:
        while True:
            busy = await self.llama.busy_tasks()
            metrics = await self.llama.metrics()
            self.busy_seen.append(busy)
            self.max_busy = max(self.max_busy, len(busy))
            self.max_deferred = max(self.max_deferred, metrics["requests_deferred"])
            self.max_processing = max(self.max_processing, metrics["requests_processing"])
            self.samples += 1
            await asyncio.sleep(POLL_S)


@pytest.fixture
async def watching(llama: Llama) -> AsyncIterator[Callable[[], Watch]]:
    """Start a Watch of llama.cpp; it stops when the test ends."""
    tasks: list[asyncio.Task[None]] = []

    def start() -> Watch:
        watch = Watch(llama)
        tasks.append(asyncio.create_task(watch.run()))
        return watch

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    # No keep-alive: leaving a response early must close its connection, as a client that
    # goes away does.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        yield c


@pytest.fixture
async def llama(engine: LocalEngine, client: httpx.AsyncClient) -> Llama:
    view = Llama(engine.url, client)
    await view.idle()
    return view


GateFactory = Callable[..., Any]


@pytest.fixture
async def start_gate(engine: LocalEngine, llama: Llama) -> AsyncIterator[GateFactory]:
    """slotgate in front of the engine with the given settings, once it knows the capacity."""
    running: list[RunningGate] = []

    async def start(**overrides: Any) -> RunningGate:
        values: dict[str, Any] = {
            "llama_server_url": engine.url,
            "max_queue": 2,
            "keepalive_interval_s": 0,
            "log_level": "warning",
        }
        values.update(overrides)
        gate = await serve(Settings(_env_file=None, **values))
        running.append(gate)
        await eventually(lambda: gate.service.upstream.ready, timeout_s=10)
        return gate

    yield start
    for gate in running:
        await gate.stop()
