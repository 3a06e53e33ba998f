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

from tests.conftest import CHAT, GateFactory, GatesFor, MakeRouter, RunningGate
from tests.support.router import children, hosted
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


async def test_a_waiter_in_a_models_line_preempts_only_a_request_on_that_models_slots(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(1), "beta": hosted(1)})
    for child in children(upstream).values():
        # One slot each, held a minute before the first token, the head sent with it.
        child.tokens, child.hold_s, child.late_head = 1, 60.0, True
    gate = await gate_before(upstream, preempt_after_s=0.3, max_queue=0)
    lanes = gate.service.models
    alpha, beta = lanes.find("alpha"), lanes.find("beta")
    assert alpha is not None
    assert beta is not None

    def batch(model: str) -> asyncio.Task[httpx.Response]:
        body = {**said(f"batch {model}", stream=True), "model": model}
        return asyncio.create_task(client.post(gate.url + CHAT, json=body, headers=BATCH))

    held = [batch("alpha")]
    await gate.until(lambda: alpha.admission.active == 1)
    # beta's batch request starts last: the most recent, were lines not told apart.
    held.append(batch("beta"))
    await gate.until(lambda: beta.admission.active == 1)
    chat = asyncio.create_task(
        client.post(gate.url + CHAT, json={**said("chat"), "model": "alpha"})
    )
    await gate.until(lambda: "chat" in prompts(children(upstream)["alpha"]))
    for child in children(upstream).values():
        child.hold_s = 0
    upstream.hurry()  # the router's connections serve its children's requests
    assert [a.status_code for a in await asyncio.gather(chat, *held)] == [200] * 3
    assert Counter(prompts(children(upstream)["alpha"])) == {"batch alpha": 2, "chat": 1}
    assert prompts(children(upstream)["beta"]) == ["batch beta"]
    assert (await client.get(gate.url + "/admission")).json()["preemptions"] == 1
