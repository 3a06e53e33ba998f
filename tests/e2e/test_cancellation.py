"""Clients that leave, against the real llama.cpp server: assembled non-streamed answers, and
chaos. llama.cpp's slots must be idle again soon after the last client left."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import POLL_S, GateFactory, Llama, Watch, chat, eventually

pytestmark = pytest.mark.e2e


async def test_an_assembled_answer_has_the_fields_of_llama_cpps_own(
    start_gate: GateFactory, client: httpx.AsyncClient, llama: Llama
) -> None:
    gate = await start_gate()
    # The first non-streamed chat goes as sent: it shows llama-server adds no __verbose.
    assert (
        await client.post(gate.url + "/v1/chat/completions", json=chat(1, stream=False))
    ).status_code == 200
    body = chat(12, stream=False, content="Say hello.")
    assembled = (await client.post(gate.url + "/v1/chat/completions", json=body)).json()
    direct = (await client.post(llama.url + "/v1/chat/completions", json=body)).json()
    assert set(assembled) >= set(direct) - {"system_fingerprint"}
    assert assembled["object"] == direct["object"] == "chat.completion"
    choice, own = assembled["choices"][0], direct["choices"][0]
    assert set(choice) == set(own)
    assert choice["finish_reason"] == own["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["message"]["content"]
    assert assembled["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 12
    assert assembled["timings"]["predicted_n"] == 12

    completions = {"prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}
    text = (await client.post(gate.url + "/v1/completions", json=completions)).json()
    assert text["object"] == "text_completion"
    assert text["choices"][0]["text"]
    assert text["usage"]["completion_tokens"] == 6
    native = {"prompt": "Once upon a time", "n_predict": 6, "ignore_eos": True}
    raw = (await client.post(gate.url + "/completion", json=native)).json()
    own_raw = (await client.post(llama.url + "/completion", json=native)).json()
    assert raw["content"]
    assert raw["tokens_predicted"] == own_raw["tokens_predicted"] == 6
    assert set(raw) >= set(own_raw) - {"tokens"}


async def test_a_native_completion_of_two_prompts_is_assembled_as_llama_cpp_answers_it(
    start_gate: GateFactory, client: httpx.AsyncClient, llama: Llama
) -> None:
    gate = await start_gate()
    native = {"prompt": ["Once upon a time", "The capital of France"], "n_predict": 6,
              "ignore_eos": True, "temperature": 0}  # fmt: skip
    assembled = (await client.post(gate.url + "/completion", json=native)).json()
    direct = (await client.post(llama.url + "/completion", json=native)).json()
    assert isinstance(direct, list)
    assert isinstance(assembled, list)
    assert [answer["index"] for answer in assembled] == [own["index"] for own in direct] == [0, 1]
    for answer, own in zip(assembled, direct, strict=True):
        assert answer["tokens_predicted"] == own["tokens_predicted"] == 6
        assert answer["content"]
        assert set(answer) >= set(own) - {"tokens"}


@pytest.mark.parametrize("stream_upstream", [True, False])
async def test_a_non_streamed_client_that_leaves_while_another_streams(
    start_gate: GateFactory,
    client: httpx.AsyncClient,
    llama: Llama,
    stream_upstream: bool,
    record_property: Any,
) -> None:
    """With STREAM_UPSTREAM on, llama.cpp frees the abandoned slot at once; off, it cannot
    tell (its 1-second poll never fires while another request streams) and runs on."""
    gate = await start_gate(stream_upstream=stream_upstream)
    # The first non-streamed chat goes as sent: it shows llama-server adds no __verbose.
    assert (
        await client.post(gate.url + "/v1/chat/completions", json=chat(1, stream=False))
    ).status_code == 200
    other = asyncio.create_task(
        client.post(gate.url + "/v1/chat/completions", json=chat(400, stream=True))
    )
    leaver = asyncio.create_task(
        client.post(gate.url + "/v1/chat/completions", json=chat(400, stream=False))
    )
    await eventually(lambda: busy(llama, 2), timeout_s=30, every_s=POLL_S)
    leaver.cancel()
    left_at = time.monotonic()
    try:
        freed_s: float | None = await eventually(
            lambda: busy(llama, 1), timeout_s=6, every_s=POLL_S
        )
    except TimeoutError:
        freed_s = None
    other.cancel()
    record_property(f"stream_upstream_{stream_upstream}_freed_s", freed_s)
    print(f"\nSTREAM_UPSTREAM={stream_upstream}: llama.cpp freed the slot of a non-streamed "  # noqa: T201
          f"client that left after {freed_s} s (None: not within 6 s)")  # fmt: skip
    await eventually(lambda: gate.service.admission.active == 0, timeout_s=5)
    if stream_upstream:
        assert freed_s is not None
        assert freed_s <= 3.0
    else:
        assert freed_s is None  # llama.cpp's documented blind spot, which the default avoids
        assert time.monotonic() - left_at >= 6


async def busy(llama: Llama, count: int) -> bool:
    return len(await llama.busy_tasks()) == count


async def test_clients_dropping_at_random_moments_leave_llama_cpp_idle(
    start_gate: GateFactory, llama: Llama, watching: Any, record_property: Any
) -> None:
    gate = await start_gate(max_queue=0)
    watch: Watch = watching()
    rng = random.Random(3)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    async def one(i: int, client: httpx.AsyncClient) -> str:
        # Mixed: streamed and not, leaving while queued, at admission, mid-generation, or
        # staying to the end.
        await asyncio.sleep(rng.random() * 2)
        body = chat(rng.choice((4, 40, 200)), stream=i % 2 == 0)
        request = asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=body))
        if rng.random() < 0.2:
            return str((await request).status_code)
        await asyncio.sleep(rng.random() * 3)
        request.cancel()
        return "dropped"

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        outcomes = await asyncio.gather(*(one(i, client) for i in range(40)))
    last_drop = time.monotonic()
    await eventually(lambda: gate.service.admission.active == 0, timeout_s=30)
    assert gate.service.admission.queued == 0
    idle_s = await eventually(lambda: busy(llama, 0), timeout_s=10, every_s=POLL_S)
    since_last = time.monotonic() - last_drop
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    record_property("chaos_outcomes", counts)
    record_property("chaos_idle_after_last_drop_s", round(since_last, 2))
    print(f"\nchaos: {counts}; max deferred {watch.max_deferred}; llama.cpp idle "  # noqa: T201
          f"{since_last:.2f} s after the last drop (polled every {POLL_S} s)")  # fmt: skip
    assert outcomes.count("dropped") >= 20
    assert idle_s <= 3.0
    assert watch.max_busy <= 2
    # Not asserted to be 0 here, unlike the burst without drops: llama.cpp notices a closed
    # connection only at its next write (one decode step, or the end of prompt processing), and
    # the slot slotgate freed at the close may already carry the next request, which waits that
    # long inside llama.cpp. Reported, so the window stays visible.
    record_property("chaos_max_deferred", watch.max_deferred)
