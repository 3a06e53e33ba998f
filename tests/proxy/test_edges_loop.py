"""Where a waiting request's body is parsed, and what a refused one gives back."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import GateFactory
from tests.gate.test_budget import words
from tests.proxy.test_edges_merged import BIG, CHAT, big_chat, settled
from tests.support.standin import StandIn


def loop_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the bodies over 1 MiB that orjson parses on the event loop's thread."""
    sizes: list[int] = []
    loads = orjson.loads
    main = threading.main_thread()

    def recording(data: Any) -> Any:
        if len(data) > BIG // 2 and threading.current_thread() is main:
            sizes.append(len(data))
        return loads(data)

    monkeypatch.setattr(orjson, "loads", recording)
    return sizes


async def test_a_big_body_is_not_parsed_on_the_loop_when_llama_server_becomes_known(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = await start_gate()
    await client.post(gate.url + CHAT, json={"messages": []})  # warm: a hold is observed
    standin.loading = True
    gate.service.upstream.poke()
    await gate.until(lambda: gate.service.admission.capacity is None)
    sizes = loop_parses(monkeypatch)
    asked = asyncio.create_task(client.post(gate.url + CHAT, json=big_chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert sizes == []
    standin.loading = False
    assert (await asked).status_code == 200
    assert sizes == []  # today: [1114225], the weigh closure's demand() at resize
    await gate.until(lambda: settled(gate))


@pytest.fixture
async def counting() -> AsyncIterator[StandIn]:
    upstream = StandIn(total_slots=2, tokens=1000, token_delay_s=0.02, counts=True)
    await upstream.start()
    yield upstream
    await upstream.stop()


async def test_a_waiter_refused_because_its_prompt_never_fits_gives_back_its_body_bytes(
    start_gate: GateFactory, counting: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(llama_server_url=counting.url, kv_budget_tokens=1000)
    held = [
        asyncio.create_task(client.post(gate.url + CHAT, json=words(10, max_tokens=50)))
        for _ in range(2)
    ]
    await gate.until(lambda: gate.service.admission.active == 2)
    for _ in range(3):
        answer = await client.post(gate.url + CHAT, json=words(1200))
        assert answer.json()["error"]["type"] == "exceed_context_size_error"
    assert gate.service.admission.queued == 0
    assert (
        gate.service.proxy.body_bytes.held == 0
    )  # today: 7,491 (3 x 2,497 bytes), never given back
    for task in held:
        task.cancel()
