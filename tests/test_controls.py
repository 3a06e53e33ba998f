"""The operator controls against real sockets: a drain never cuts a running request, a pause
never loses a waiter, a cancel frees the slot at once; who may use them; one log line and one
count each."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from slotgate.controls import Operators
from slotgate.errors import Forbidden, Unauthorized
from slotgate.gate.tenants import label
from slotgate.main import Service
from slotgate.settings import Settings

from tests.conftest import (
    CHAT,
    GateFactory,
    RunningGate,
    StartUpstreams,
    assert_lines,
    chat,
    hold_stream_of,
    occupy,
)
from tests.support.standin import StandIn


async def act(
    client: httpx.AsyncClient, gate: RunningGate, path: str, key: str | None = None
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return await client.post(gate.url + "/admin/" + path, headers=headers)


def metric(action: str) -> str:
    return f'slotgate_operator_actions_total{{action="{action}"}}'


async def test_a_pause_never_loses_a_waiter_and_resume_serves_them_in_order(
    one_slot: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = await one_slot(max_queue=4)
    holder = await occupy(client, gate)
    caplog.set_level(logging.INFO, logger="slotgate.operator")
    paused = await act(client, gate, "pause")
    assert paused.status_code == 200
    assert paused.json() == {"ok": True, "paused": True}
    assert "operator 127.0.0.1 paused admission" in caplog.text
    waiters = [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": f"w{i}"})
        )
        for i in range(3)
    ]
    await gate.until(lambda: gate.service.admission.queued == 3)
    # The running stream finishes; its slot is handed to nobody while paused.
    standin.hurry()
    await holder
    await gate.until(lambda: gate.service.admission.active == 0)
    await asyncio.sleep(0.1)  # a hand-off would have happened in this time; none may
    view = (await client.get(gate.url + "/admission")).json()
    assert (view["paused"], view["active"], view["queued"]) == (True, 0, 3)
    assert all(not w.done() for w in waiters)
    # The line's bound still holds while paused.
    over = [asyncio.create_task(client.post(gate.url + CHAT, json=chat())) for _ in range(2)]
    done, _ = await asyncio.wait(over, return_when=asyncio.FIRST_COMPLETED)
    first = done.pop()
    refused = first.result()
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    resumed = await act(client, gate, "resume")
    assert resumed.json() == {"ok": True, "paused": False}
    answers = await asyncio.gather(*waiters, *[t for t in over if t is not first])
    assert [a.status_code for a in answers] == [200] * 4
    text = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert_lines(text, metric("pause") + " 1.0", metric("resume") + " 1.0")
    assert "slotgate_admission_paused 0.0" in text


async def test_a_drained_upstream_finishes_its_running_stream_and_gets_nothing_new(
    start_gate: GateFactory,
    standin: StandIn,
    start_upstreams: StartUpstreams,
    client: httpx.AsyncClient,
) -> None:
    other = StandIn(total_slots=1)
    await start_upstreams(other)
    standin.total_slots = 1
    standin.tokens, standin.token_delay_s = 20, 0.05
    gate = await start_gate(llama_server_url=f"{standin.url},{other.url}")
    await gate.until(lambda: all(u.ready for u in gate.service.fleet))
    started = asyncio.Event()
    # Least loaded first: with both free, which one runs it is drawn; find it after.
    chunks: list[bytes] = []
    holder = asyncio.create_task(hold_stream_of(client, gate, chat(stream=True), started))
    await started.wait()
    busy = standin if standin.running else other
    name = next(u.name for u in gate.service.fleet if u.url == busy.url)
    drained = await act(client, gate, f"upstreams/{name}/drain")
    assert drained.json() == {"ok": True, "upstream": name, "draining": True}
    view = (await client.get(gate.url + "/admission")).json()
    entry = next(u for u in view["upstreams"] if u["name"] == name)
    assert entry["draining"] is True
    assert view["capacity"] == 1  # the other's slot alone
    assert (await client.get(gate.url + "/readyz")).status_code == 200
    # New work goes to the other upstream only, even once the drained one is free.
    busy.hurry()
    chunks = await holder
    assert b"data: [DONE]" in b"".join(chunks)  # not cut: it ran to its end
    assert busy.cancelled == 0
    before = busy.started
    for _ in range(6):  # each would go to either, were the drained one not out
        assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    assert busy.started == before
    restored = await act(client, gate, f"upstreams/{name}/restore")
    assert restored.json()["draining"] is False
    assert (await client.get(gate.url + "/admission")).json()["capacity"] == 2
    unknown = await act(client, gate, "upstreams/nowhere:1/drain")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found"


async def test_draining_every_ready_upstream_makes_slotgate_not_ready(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    name = gate.service.upstream.name
    await act(client, gate, f"upstreams/{name}/drain")
    readyz = await client.get(gate.url + "/readyz")
    assert readyz.status_code == 503
    assert readyz.json()["reason"] == "every ready upstream is drained"
    await act(client, gate, f"upstreams/{name}/restore")
    assert (await client.get(gate.url + "/readyz")).status_code == 200


async def test_a_cancelled_waiter_leaves_the_line_with_a_final_503(
    one_slot_held: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held()
    waiter = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": "stuck-1"})
    )
    await gate.until(lambda: "stuck-1" in gate.service.proxy.running)
    cancelled = await act(client, gate, "requests/stuck-1/cancel")
    assert cancelled.json() == {"ok": True, "request_id": "stuck-1", "cancelled": True}
    answer = await waiter
    assert answer.status_code == 503
    assert answer.headers["x-should-retry"] == "false"
    assert "retry-after" not in answer.headers
    assert answer.json()["error"]["code"] == "cancelled_by_operator"
    assert gate.service.admission.queued == 0
    again = await act(client, gate, "requests/stuck-1/cancel")
    assert again.status_code == 404
    text = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert 'slotgate_requests_rejected_total{family="chat",reason="cancelled"} 1.0' in text
    assert 'slotgate_queue_wait_seconds_count{family="chat",outcome="cancelled"} 1.0' in text


async def test_a_cancelled_stream_frees_its_slot_at_once_and_its_upstream_stops(
    one_slot: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = await one_slot(tokens=1000)
    caplog.set_level(logging.INFO, logger="slotgate.operator")
    chunks: list[bytes] = []
    started = asyncio.Event()

    async def stream() -> None:
        async with client.stream(
            "POST", gate.url + CHAT, json=chat(stream=True), headers={"x-request-id": "long-1"}
        ) as response:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                started.set()

    running = asyncio.create_task(stream())
    await started.wait()
    await gate.until(lambda: "long-1" in gate.service.proxy.running)
    waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert (await act(client, gate, "requests/long-1/cancel")).status_code == 200
    # The slot went to the waiter: nothing of the cancelled request holds it.
    await gate.until(lambda: gate.service.admission.queued == 0)
    await running
    body = b"".join(chunks)
    assert b'"code":"cancelled_by_operator"' in body
    assert b"[DONE]" not in body
    # llama-server saw its connection close and stopped generating.
    await gate.until(lambda: standin.cancelled == 1)
    standin.hurry()
    assert (await waiter).status_code == 200
    assert "operator 127.0.0.1 cancelled request long-1" in caplog.text


async def test_a_cancelled_non_streamed_request_gets_the_error_in_its_routes_shape(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(tokens=1000)
    body = {"model": "m", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]}
    running = asyncio.create_task(
        client.post(gate.url + "/v1/messages", json=body, headers={"x-request-id": "msg-1"})
    )
    await gate.until(lambda: standin.running == 1 and "msg-1" in gate.service.proxy.running)
    assert (await act(client, gate, "requests/msg-1/cancel")).status_code == 200
    answer = await running
    assert answer.status_code == 503
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "overloaded_error"
    assert answer.json()["error"]["code"] == "cancelled_by_operator"
    assert gate.service.admission.active == 0
    await gate.until(lambda: standin.cancelled == 1)


async def test_admin_keys_open_the_controls_and_nothing_else(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="client-key", admin_keys="ops-key")
    assert (await act(client, gate, "pause")).status_code == 401
    refused = await act(client, gate, "pause", "client-key")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert (await act(client, gate, "pause", "ops-key")).status_code == 200
    assert gate.service.gate.paused
    assert (await act(client, gate, "resume", "ops-key")).status_code == 200
    # An admin key is no API key.
    chat_answer = await client.post(
        gate.url + CHAT, json=chat(), headers={"authorization": "Bearer ops-key"}
    )
    assert chat_answer.status_code == 401


async def test_api_keys_without_admin_keys_leave_the_controls_shut(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="client-key")
    for key in (None, "client-key"):
        refused = await act(client, gate, "pause", key)
        assert refused.status_code == 403
        assert "ADMIN_KEYS" in refused.json()["error"]["message"]
    assert not gate.service.gate.paused


async def test_without_keys_only_loopback_clients_may_act() -> None:
    service = Service(Settings(_env_file=None))
    operators: Operators = service.operators
    assert operators.who("127.0.0.1", None) == "127.0.0.1"
    assert operators.who("::1", None) == "::1"
    with pytest.raises(Forbidden):
        operators.who("10.1.2.3", None)
    with pytest.raises(Forbidden):
        operators.who(None, None)
    keyed = Service(Settings(_env_file=None, admin_keys="ops")).operators
    assert keyed.who("10.1.2.3", b"Bearer ops") == label(b"ops")
    with pytest.raises(Unauthorized):
        keyed.who("127.0.0.1", None)
