"""Three real llama.cpp engines behind one slotgate: nothing waits inside any of them, every
slot is idle right after a run, and a conversation's turns reuse its cached prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from slotgate.engine.process import LocalEngine
from slotgate.settings import Settings

from tests.conftest import RunningGate, serve
from tests.e2e.conftest import Llama, Watch, eventually

pytestmark = pytest.mark.e2e

#: A long shared start: what a system prompt is to a chat, for a raw completion.
SYSTEM = "You are a careful assistant who answers in one short line. " * 12


@pytest.fixture(scope="module")
def two_more() -> Iterator[list[LocalEngine]]:
    """Two engines beside the session's, of one slot each (1 thread: 2 cores are shared)."""
    engines = [
        LocalEngine.from_args(model=None, demo=True, parallel=1, ctx_size=1024, threads=1)
        for _ in range(2)
    ]
    try:
        for engine in engines:
            engine.start()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture
async def fleet_gate(
    engine: LocalEngine, two_more: list[LocalEngine], client: httpx.AsyncClient
) -> AsyncIterator[tuple[RunningGate, list[Llama]]]:
    engines = [engine, *two_more]
    llamas = [Llama(e.url, client) for e in engines]
    for llama in llamas:
        await llama.idle()
    settings = Settings(
        _env_file=None,
        llama_server_url=",".join(e.url for e in engines),
        max_queue=0,
        keepalive_interval_s=0,
        log_level="warning",
    )
    gate = await serve(settings)
    try:
        await eventually(lambda: gate.service.admission.capacity == 4, timeout_s=10)
        yield gate, llamas
    finally:
        await gate.stop()


def completion(prompt: str, n_predict: int = 4, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, **extra}


async def test_a_burst_over_three_engines_never_waits_inside_one_and_leaves_every_slot_idle(
    fleet_gate: tuple[RunningGate, list[Llama]], client: httpx.AsyncClient
) -> None:
    gate, llamas = fleet_gate
    watches = [Watch(llama) for llama in llamas]
    tasks = [asyncio.create_task(watch.run()) for watch in watches]
    try:
        answers = await asyncio.gather(
            *(
                client.post(gate.url + "/completion", json=completion(f"{n}: {SYSTEM}"))
                for n in range(10)
            )
        )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert [a.status_code for a in answers] == [200] * 10
    assert [w.max_deferred for w in watches] == [0, 0, 0]
    assert all(w.samples > 0 for w in watches)
    # Every upstream did its share of the work.
    assert all(
        pool.routed["affinity"] + pool.routed["load"] > 0 for pool in gate.service.admission.pools
    )

    async def all_idle() -> bool:
        return not any([await llama.busy_tasks() for llama in llamas])

    await eventually(all_idle, timeout_s=1.0, every_s=0.1)


async def test_each_turn_of_a_conversation_reuses_the_prompt_its_last_turn_left_cached(
    fleet_gate: tuple[RunningGate, list[Llama]], client: httpx.AsyncClient
) -> None:
    gate, _ = fleet_gate
    reused: list[float] = []
    for conversation in range(3):
        history = f"{SYSTEM}\nConversation {conversation}.\nUser: hello\nAssistant:"
        for turn in range(3):
            answer = await client.post(gate.url + "/completion", json=completion(history))
            assert answer.status_code == 200
            body = answer.json()
            timings = body["timings"]
            if turn:
                reused.append(timings["cache_n"] / (timings["cache_n"] + timings["prompt_n"]))
            history += body["content"] + f"\nUser: and {turn}?\nAssistant:"
    # Routed to where its last turn ran, every later turn finds its history cached.
    assert min(reused) > 0.8, reused
