"""slotgate in front of the real llama.cpp server: capacity, the line, 429, client exits, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from slotgate.engine.process import LocalEngine

from tests.conftest import RunningGate
from tests.e2e.conftest import POLL_S, GateFactory, Llama, Watch, chat, eventually

pytestmark = pytest.mark.e2e

SLOTS = 2
LINE = 2


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    body: bytes
    first_token_at: float | None


async def fetch(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        content = b""
        first_token_at = None
        async for chunk in response.aiter_raw():
            content += chunk
            if first_token_at is None and b'"content":"' in content:
                first_token_at = time.monotonic()
        return Answer(response.status_code, response.headers, content, first_token_at)


@contextlib.asynccontextmanager
async def generating(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> AsyncIterator[AsyncIterator[bytes]]:
    """A stream that has delivered its first token; leaving the block hangs up on it."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = response.aiter_raw()
        first = b""
        while b'"content":"' not in first:
            first += await anext(chunks)
        yield chunks


async def test_capacity_is_read_from_llama_cpp_props(
    engine: LocalEngine, start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()

    props = (await client.get(engine.url + "/props")).json()
    pool = (await client.get(gate.url + "/admission")).json()

    assert props["total_slots"] == SLOTS
    assert pool["capacity"] == SLOTS
    assert pool["free"] == SLOTS
    assert pool["queue_limit"] == LINE
    assert pool["upstream"]["ready"] is True
    assert pool["upstream"]["n_ctx"] == props["default_generation_settings"]["n_ctx"] == 1024


async def test_a_burst_beyond_slots_and_line_gets_exactly_the_excess_refused_with_429(
    start_gate: GateFactory,
    client: httpx.AsyncClient,
    watching: Any,
    record_property: Any,
) -> None:
    gate = await start_gate()
    watch: Watch = watching()
    burst = SLOTS + LINE + 3

    answers = await asyncio.gather(
        *(fetch(client, gate.url, chat(40, stream=True)) for _ in range(burst))
    )
    await asyncio.sleep(POLL_S)  # one more look at llama.cpp after the last stream ended

    served = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 429]
    assert [a.body for a in answers if a.status not in (200, 429)] == []
    assert len(served) == SLOTS + LINE
    assert len(refused) == burst - SLOTS - LINE
    for answer in served:
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.body.count(b'"content":"') >= 40
        assert answer.body.endswith(b"data: [DONE]\n\n")
    for answer in refused:
        error = json.loads(answer.body)["error"]
        assert error["type"] == "rate_limit_error"
        assert error["code"] == "queue_full"
        assert error["param"] is None
        assert error["message"].startswith(
            f"llama-server generation queue is full (active={SLOTS}, queued={LINE}, "
            f"capacity={SLOTS})"
        )
        pool = error["admission"]
        retry_after_s = pool.pop("retry_after_s")
        assert pool == {
            "capacity": SLOTS, "active": SLOTS, "queued": LINE, "free": 0, "queue_limit": LINE
        }  # fmt: skip
        assert 1 <= retry_after_s <= 60
        # Whole seconds, rounded to the nearest: within half a second of the estimate.
        assert abs(int(answer.headers["retry-after"]) - retry_after_s) <= 0.5
        assert int(answer.headers["retry-after-ms"]) == round(retry_after_s * 1000)
        assert answer.headers["x-should-retry"] == "true"
    # slotgate did the queueing: llama.cpp was kept busy, but never had more than its slots.
    assert watch.samples >= 4
    assert watch.max_busy == SLOTS
    assert watch.max_processing == SLOTS
    assert watch.max_deferred == 0
    record_property("llamacpp_requests_deferred_max", watch.max_deferred)
    record_property("llamacpp_busy_slots_max", watch.max_busy)
    print(  # noqa: T201 - the figures the issue asks to report
        f"\nburst of {burst}: {len(served)} served, {len(refused)} refused with 429; "
        f"llama.cpp busy slots max {watch.max_busy}, requests_deferred max "
        f"{watch.max_deferred:g} over {watch.samples} samples"
    )


async def test_a_client_leaving_mid_stream_frees_its_llama_cpp_slot_for_the_next_waiter(
    start_gate: GateFactory,
    client: httpx.AsyncClient,
    llama: Llama,
    watching: Any,
    record_property: Any,
) -> None:
    gate = await start_gate()
    admission = gate.service.admission
    watch: Watch = watching()

    async with generating(client, gate.url, chat(1000, stream=True)) as staying:
        async with generating(client, gate.url, chat(1000, stream=True)):
            before = await llama.busy_tasks()
            assert len(before) == SLOTS
            waiter = asyncio.create_task(fetch(client, gate.url, chat(8, stream=True)))
            await eventually(lambda: admission.queued == 1, timeout_s=5)
        left_at = time.monotonic()  # the block above hung up on the second stream

        await eventually(lambda: admission.queued == 0, timeout_s=5)
        admitted_s = time.monotonic() - left_at
        await eventually(lambda: llama_changed(llama, before), timeout_s=5, every_s=POLL_S)
        freed_s = time.monotonic() - left_at
        answer = await asyncio.wait_for(waiter, timeout=30)
        assert await anext(staying)  # the other stream never noticed

    assert answer.status == 200
    assert answer.body.endswith(b"data: [DONE]\n\n")
    assert answer.first_token_at is not None
    first_token_s = answer.first_token_at - left_at
    assert freed_s <= 3.0  # "within about a second", sampled every POLL_S
    assert watch.max_busy <= SLOTS
    # The next waiter at most, and only until llama.cpp notices the closed connection at its
    # next write (one decode step, long on a loaded machine): the slot slotgate freed at the
    # close already carries it (as in the chaos test of test_cancellation.py).
    assert watch.max_deferred <= 1
    record_property("llamacpp_requests_deferred_max", watch.max_deferred)
    record_property("slot_freed_after_disconnect_s", round(freed_s, 2))
    record_property("next_waiter_admitted_after_disconnect_s", round(admitted_s, 3))
    record_property("next_waiter_first_token_after_disconnect_s", round(first_token_s, 3))
    print(  # noqa: T201 - the figures the issue asks to report
        f"\nafter a disconnect: slotgate admitted the next waiter in {admitted_s:.3f} s, whose "
        f"first token came {first_token_s:.2f} s after the disconnect; llama.cpp's /slots "
        f"showed the slot changing hands within {freed_s:.2f} s (polled every {POLL_S} s)"
    )


async def llama_changed(llama: Llama, before: set[int]) -> bool:
    """llama.cpp no longer runs every task it ran before: one of them gave up its slot."""
    return not before <= await llama.busy_tasks()


async def assert_a_waiter_that_leaves_never_reaches_llama_cpp(
    gate: RunningGate,
    client: httpx.AsyncClient,
    llama: Llama,
    watch: Watch,
    leave: Callable[[], Awaitable[None]],
) -> None:
    """With both slots held by long streams, `leave()` puts a waiter in the line and has it
    leave; once a slot is free, llama.cpp must not have seen it."""
    admission = gate.service.admission
    async with generating(client, gate.url, chat(1000, stream=True)):
        async with generating(client, gate.url, chat(1000, stream=True)):
            prompts_before = (await llama.metrics())["prompt_tokens_total"]
            await leave()
            await eventually(lambda: admission.queued == 0, timeout_s=1)
        # A slot is free now: a waiter that had not really left would take it.
        await asyncio.sleep(2 * POLL_S)
        assert admission.active == 1
        assert len(await llama.busy_tasks()) == 1
    await llama.idle()

    assert (await llama.metrics())["prompt_tokens_total"] == prompts_before
    assert all(slot["params"]["n_predict"] == 1000 for slot in await llama.slots())
    assert watch.max_deferred == 0


async def test_a_client_leaving_the_line_never_reaches_llama_cpp(
    start_gate: GateFactory,
    client: httpx.AsyncClient,
    llama: Llama,
    watching: Any,
) -> None:
    gate = await start_gate()
    # A length nobody else asks for, so llama.cpp's /slots would show it had it run.
    quitter = chat(7, stream=False, content="A question nobody else asks: why is the sky blue?")

    async def leave() -> None:
        waiting = asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=quitter))
        await eventually(lambda: gate.service.admission.queued == 1, timeout_s=5)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    await assert_a_waiter_that_leaves_never_reaches_llama_cpp(
        gate, client, llama, watching(), leave
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_a_prompt_longer_than_a_slot_gets_llama_cpp_own_400_unchanged(
    engine: LocalEngine, start_gate: GateFactory, client: httpx.AsyncClient, stream: bool
) -> None:
    gate = await start_gate(keepalive_interval_s=5)
    body = chat(8, stream=stream, content="word " * 1500)

    direct = await fetch(client, engine.url, body)
    proxied = await fetch(client, gate.url, body)

    assert direct.status == proxied.status == 400
    assert proxied.headers["content-type"].startswith("application/json")
    assert json.loads(proxied.body) == json.loads(direct.body)
    error = json.loads(proxied.body)["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 1024
    assert error["n_prompt_tokens"] > 1024


async def test_a_header_line_llama_cpp_would_refuse_is_refused_by_slotgate_first(
    engine: LocalEngine, start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    body = chat(1, stream=False)
    # "x-big: " + value + CRLF: 8192 bytes is the longest line llama.cpp's HTTP library takes.
    longest, too_long = {"X-Big": "a" * (8192 - 9)}, {"X-Big": "a" * (8192 - 8)}
    for url in (engine.url, gate.url):
        accepted = await client.post(url + "/v1/chat/completions", json=body, headers=longest)
        assert accepted.status_code == 200, url
    refused = await client.post(engine.url + "/v1/chat/completions", json=body, headers=too_long)
    assert refused.status_code == 400
    assert refused.content == b""  # llama.cpp's answer: no error a client could read
    ours = await client.post(gate.url + "/v1/chat/completions", json=body, headers=too_long)
    assert ours.status_code == 431
    assert ours.json()["error"]["code"] == "headers_too_large"


async def test_waiters_handed_a_slot_as_a_stream_ends_are_all_served(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    # Many short streams through a deep line: every one of them ends in a hand-over. llama.cpp
    # closes the connection after each streamed answer though its head says Keep-Alive; a
    # connection pooled anyway would fail the waiter sent down it. slotgate learns this from
    # the first streams and never pools a stream's connection to it.
    gate = await start_gate(max_queue=0)
    streams = 150

    answers = await asyncio.gather(
        *(fetch(client, gate.url, chat(1, stream=True)) for _ in range(streams))
    )

    failed = [(a.status, a.body[:200]) for a in answers if a.status != 200]
    assert failed == []
    assert all(a.body.endswith(b"data: [DONE]\n\n") for a in answers)
    assert gate.service.upstream.keeps_streams is False
