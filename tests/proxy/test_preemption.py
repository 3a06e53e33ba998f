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


async def chat_preempting(
    gate: RunningGate,
    standin: StandIn,
    client: httpx.AsyncClient,
    batch: list[asyncio.Task[httpx.Response]],
) -> list[httpx.Response]:
    """Send a chat, which reaches llama-server only by preempting a batch request; then let
    everything end: the chat's answer, then the batch requests'."""
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    await gate.until(lambda: "chat" in prompts(standin))
    standin.hold_s = 0
    standin.hurry()
    return await asyncio.gather(chat, *batch)


def send_batch(
    gate: RunningGate, client: httpx.AsyncClient, count: int, stream: bool = True
) -> list[asyncio.Task[httpx.Response]]:
    """`count` batch requests, "batch 0" onwards, sent at once."""
    return [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=said(f"batch {n}", stream=stream), headers=BATCH)
        )
        for n in range(count)
    ]


async def preemptions(gate: RunningGate, client: httpx.AsyncClient) -> int | None:
    """The preemptions `/admission` counts (None: preemption is off)."""
    count: int | None = (await client.get(gate.url + "/admission")).json()["preemptions"]
    return count


async def chat_left_waiting(
    gate: RunningGate, standin: StandIn, client: httpx.AsyncClient
) -> asyncio.Task[httpx.Response]:
    """Send a chat behind requests that hold every slot with their generations begun: it
    waits three times its bound and preempts none of them."""
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    await gate.until(lambda: gate.service.admission.queued == 1)
    await asyncio.sleep(1.0)  # over three times its bound
    assert "chat" not in prompts(standin)
    assert await preemptions(gate, client) == 0
    return chat


async def test_a_waiting_interactive_request_preempts_a_batch_request_that_sent_nothing(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await preempting_gate(start_gate, standin)
    batch = send_batch(gate, client, 8)
    await gate.until(lambda: gate.service.admission.queued == 6)
    # Both batch generations would hold their slots for a minute: the chat runs long before.
    answers = await chat_preempting(gate, standin, client, batch)
    assert [a.status_code for a in answers] == [200] * 9
    sent = Counter(prompts(standin))
    # One batch request was cut before its first byte and sent again; none was lost.
    assert sorted(sent.values()) == [1] * 8 + [2]
    assert sent["chat"] == 1
    assert await preemptions(gate, client) == 1
    assert gate.service.admission.active == 0


async def test_a_batch_request_whose_answer_has_begun_is_never_preempted(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await preempting_gate(start_gate, standin)
    # Streamed: tokens flow to their clients for a minute.
    standin.hold_s, standin.tokens, standin.token_delay_s = 0, 1200, 0.05
    batch = send_batch(gate, client, 2)
    await gate.until(lambda: gate.service.admission.active == 2)
    chat = await chat_left_waiting(gate, standin, client)
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
    batch = send_batch(gate, client, 2, stream=False)
    await gate.until(lambda: gate.service.admission.active == 2)
    await gate.until(lambda: standin.running == 2)
    chat = await chat_left_waiting(gate, standin, client)
    standin.hurry()
    assert [a.status_code for a in await asyncio.gather(chat, *batch)] == [200] * 3


async def test_a_stream_that_waited_long_enough_for_its_head_is_still_preempted_cleanly(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    # Its head and `: queued` comments are slotgate's, not llama-server's answer: sent again,
    # its client reads one head and one clean stream. (Immune, a backlog of batch streams that
    # all waited STREAM_HEAD_AFTER_S would leave nothing to preempt.)
    standin.total_slots, standin.tokens, standin.hold_s = 2, 3, 60.0
    standin.late_head = True
    gate = await start_gate(
        preempt_after_s=0.3, max_queue=0, stream_head_after_s=0, keepalive_interval_s=0.05
    )
    # Two interactive requests hold both slots while the batch streams wait, heads out.
    blockers = [
        asyncio.create_task(client.post(gate.url + CHAT, json=said(f"block {n}"))) for n in range(2)
    ]
    await gate.until(lambda: standin.running == 2)
    batch = send_batch(gate, client, 2)
    await gate.until(lambda: gate.service.admission.queued == 2)
    await asyncio.sleep(0.2)  # their heads and a few comments go out
    standin.hurry()  # the blockers end; the batch streams run, 60 s before their first token
    assert [a.status_code for a in await asyncio.gather(*blockers)] == [200, 200]
    await gate.until(lambda: prompts(standin).count("batch 1") == 1 and standin.running == 2)
    answers = await chat_preempting(gate, standin, client, batch)
    assert [a.status_code for a in answers] == [200] * 3
    for streamed in answers[1:]:
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert streamed.text.count("data: [DONE]") == 1
        assert len(events) == standin.tokens + 3  # its role, tokens, stop, [DONE]: once each
    assert sorted(Counter(prompts(standin)).values()) == [1, 1, 1, 1, 2]
    assert await preemptions(gate, client) == 1


async def test_a_request_waiting_again_for_a_restarting_llama_server_is_not_preempted(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    # Refused by a loading llama-server, it holds no slot while it waits to be sent again:
    # stopping it would free nothing, and spend the waiter's one preemption and its own.
    standin.total_slots, standin.tokens = 2, 1
    gate = await start_gate(preempt_after_s=0.3, max_queue=0, startup_wait_s=30)
    standin.loading = True
    batch = asyncio.create_task(
        client.post(gate.url + CHAT, json=said("batch", stream=True), headers=BATCH)
    )
    await gate.until(lambda: "batch" in prompts(standin) and gate.service.admission.queued == 1)
    chat = asyncio.create_task(client.post(gate.url + CHAT, json=said("chat")))
    await gate.until(lambda: gate.service.admission.queued == 2)
    await asyncio.sleep(1.0)  # over three times its bound
    assert await preemptions(gate, client) == 0
    standin.loading = False
    assert [a.status_code for a in await asyncio.gather(chat, batch)] == [200, 200]


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
    assert await preemptions(gate, client) == 0
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
    assert await preemptions(gate, client) is None
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
    assert await preemptions(gate, client) == 1
