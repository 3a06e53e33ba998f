"""Preemption before the first byte through the whole gate, in front of the stand-in: an
interactive request that waited its bound takes the slot of a batch request that has sent
nothing yet; that one is sent again later and answered once; one that has begun its answer is
never touched."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx

from tests.conftest import CHAT, GateFactory, RunningGate
from tests.support.standin import StandIn

BATCH = {"x-priority": "batch"}


def said(text: str, stream: bool = False) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "stream": stream}


def prompts(standin: StandIn) -> list[str]:
    return [json.loads(seen.body)["messages"][0]["content"] for seen in standin.seen]


async def preempting_gate(start_gate: GateFactory, standin: StandIn) -> RunningGate:
    # Two slots whose streams hold them 60 s before their first token, their head sent with
    # it (as llama-server does): only the test ends them.
    standin.total_slots, standin.tokens, standin.hold_s = 2, 1, 60.0
    standin.late_head = True
    gate: RunningGate = await start_gate(preempt_after_s=0.3, max_queue=0)
    return gate


async def test_a_waiting_interactive_request_preempts_a_batch_request_that_sent_nothing(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await preempting_gate(start_gate, standin)
    batch = [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=said(f"batch {n}", stream=True), headers=BATCH)
        )
        for n in range(8)
    ]
    await gate.until(lambda: gate.service.admission.queued == 6)
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    # Both batch generations would hold their slots for a minute: the chat runs long before.
    await gate.until(lambda: "chat" in prompts(standin))
    standin.hold_s = 0
    standin.hurry()
    answers = await asyncio.gather(chat, *batch)
    assert [a.status_code for a in answers] == [200] * 9
    sent = Counter(prompts(standin))
    # One batch request was cut before its first byte and sent again; none was lost.
    assert sorted(sent.values()) == [1] * 8 + [2]
    assert sent["chat"] == 1
    view = (await client.get(gate.url + "/admission")).json()
    assert view["preemptions"] == 1
    assert gate.service.admission.active == 0


async def test_a_batch_request_whose_answer_has_begun_is_never_preempted(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await preempting_gate(start_gate, standin)
    # Streamed: tokens flow to their clients for a minute.
    standin.hold_s, standin.tokens, standin.token_delay_s = 0, 1200, 0.05
    batch = [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=said(f"batch {n}", stream=True), headers=BATCH)
        )
        for n in range(2)
    ]
    await gate.until(lambda: gate.service.admission.active == 2)
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    await gate.until(lambda: gate.service.admission.queued == 1)
    await asyncio.sleep(1.0)  # over three times its bound
    assert "chat" not in prompts(standin)
    assert (await client.get(gate.url + "/admission")).json()["preemptions"] == 0
    standin.hurry()
    assert [a.status_code for a in await asyncio.gather(chat, *batch)] == [200] * 3


async def test_a_non_streamed_request_whose_tokens_have_begun_is_never_preempted(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    # Assembled from a stream (STREAM_UPSTREAM): its client has had no byte while its
    # generation runs, yet its tokens are work that preempting it would throw away.
    standin.total_slots, standin.tokens = 2, 1
    standin.late_head = True
    gate = await start_gate(preempt_after_s=0.3, max_queue=0)
    # Shows llama-server adds no __verbose: the next ones are assembled.
    assert (await client.post(gate.url + CHAT, json=said("warm"))).status_code == 200
    standin.tokens, standin.token_delay_s = 1200, 0.05
    batch = [
        asyncio.create_task(client.post(gate.url + CHAT, json=said(f"batch {n}"), headers=BATCH))
        for n in range(2)
    ]
    await gate.until(lambda: gate.service.admission.active == 2)
    await gate.until(lambda: standin.running == 2)
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    await gate.until(lambda: gate.service.admission.queued == 1)
    await asyncio.sleep(1.0)  # over three times its bound
    assert "chat" not in prompts(standin)
    assert (await client.get(gate.url + "/admission")).json()["preemptions"] == 0
    standin.hurry()
    assert [a.status_code for a in await asyncio.gather(chat, *batch)] == [200] * 3


async def test_a_non_streamed_request_sent_upstream_as_it_is_is_never_preempted(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    # llama-server stops a non-streamed generation whose client left only unreliably.
    standin.total_slots, standin.tokens, standin.hold_s = 1, 1, 60.0
    gate = await start_gate(preempt_after_s=0.3, stream_upstream=False, max_queue=0)
    batch = asyncio.create_task(client.post(gate.url + CHAT, json=said("batch"), headers=BATCH))
    await gate.until(lambda: gate.service.admission.active == 1)
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    await gate.until(lambda: gate.service.admission.queued == 1)
    await asyncio.sleep(1.0)  # over three times its bound
    assert prompts(standin) == ["batch"]
    assert (await client.get(gate.url + "/admission")).json()["preemptions"] == 0
    standin.hold_s = 0
    standin.hurry()
    assert [a.status_code for a in await asyncio.gather(chat, batch)] == [200, 200]


async def test_without_preempt_after_s_nothing_is_preempted(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots, standin.tokens, standin.hold_s = 1, 1, 60.0
    standin.late_head = True
    gate = await start_gate(max_queue=0)
    batch = asyncio.create_task(client.post(gate.url + CHAT, json=said("batch"), headers=BATCH))
    await gate.until(lambda: gate.service.admission.active == 1)
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    await gate.until(lambda: gate.service.admission.queued == 1)
    await asyncio.sleep(0.5)
    assert prompts(standin) == ["batch"]
    assert (await client.get(gate.url + "/admission")).json()["preemptions"] is None
    standin.hold_s = 0
    standin.hurry()
    assert [a.status_code for a in await asyncio.gather(chat, batch)] == [200, 200]
