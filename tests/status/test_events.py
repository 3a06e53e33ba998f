"""`GET /admission/events`, `/admission`'s waiting list, the page's headers and CORS: against
slotgate on a real socket, over the stand-in."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from slotgate.status.page import FILES

from tests.conftest import (
    CHAT,
    GateFactory,
    GatesFor,
    MakeRouter,
    RunningGate,
    chat,
    hold_stream_of,
    line,
    slow_model,
)
from tests.support.standin import StandIn

KEY = "sk-status-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}


async def events(
    client: httpx.AsyncClient, gate: RunningGate, **headers: str
) -> AsyncIterator[dict[str, Any]]:
    """The snapshots of one watcher, as they come, until the stream ends."""
    async with client.stream("GET", gate.url + "/admission/events", headers=headers) as answer:
        assert answer.status_code == 200, await answer.aread()
        assert answer.headers["content-type"].startswith("text/event-stream")
        buffered = b""
        async for chunk in answer.aiter_raw():
            buffered += chunk
            while b"\n\n" in buffered:
                event, buffered = buffered.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    yield json.loads(event[len(b"data: ") :])


async def test_the_stream_sends_a_snapshot_each_tick_and_builds_none_while_nobody_watches(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    hub = gate.service.events
    await asyncio.sleep(0.5)
    assert hub.built == 0  # nobody has watched yet
    seen = []
    async for snapshot in events(client, gate):
        seen.append(snapshot)
        if len(seen) == 2:
            break
    assert seen[0]["capacity"] == 2
    assert {"waiting", "recent", "upstreams", "tenants"} <= set(seen[1])
    await gate.until(lambda: hub.watchers == 0 and not hub.running)
    built = hub.built
    await asyncio.sleep(1.5)
    assert hub.built == built


async def test_one_snapshot_a_tick_serves_every_watcher(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    hub = gate.service.events

    async def two() -> None:
        count = 0
        async for _ in events(client, gate):
            count += 1
            if count == 2:
                return

    await asyncio.gather(*(two() for _ in range(5)))
    # Five watchers of two snapshots each: a snapshot a tick for all, never one each.
    assert hub.built < 10


async def test_a_watcher_past_the_limit_is_refused_with_retry_after(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(status_watchers=1)
    async for _ in events(client, gate):
        answer = await client.get(gate.url + "/admission/events")
        assert answer.status_code == 429
        assert answer.json()["error"]["code"] == "too_many_watchers"
        assert answer.headers["retry-after"] == "5"
        break
    # The first one left: its place is free again.
    await gate.until(lambda: gate.service.events.watchers == 0)
    async for _ in events(client, gate):
        break


async def test_every_stream_ends_when_the_gate_drains(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()

    async def watch() -> int:
        return sum([1 async for _ in events(client, gate)])

    watchers = [asyncio.create_task(watch()) for _ in range(3)]
    await gate.until(lambda: gate.service.events.watchers == 3)
    gate.service.drain()
    async with asyncio.timeout(30):
        counts = await asyncio.gather(*watchers)
    assert all(count >= 1 for count in counts)
    assert gate.service.events.watchers == 0


async def test_the_waiting_list_names_requests_by_id_and_tenant_never_by_key_or_body(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 400, 0.05
    gate = await start_gate(api_keys=(KEY,))
    started = asyncio.Event()

    async def hold() -> None:
        async with client.stream(
            "POST", gate.url + CHAT, json=chat(stream=True), headers=AUTH
        ) as r:
            async for _ in r.aiter_raw():
                started.set()

    holder = asyncio.create_task(hold())
    await started.wait()
    words = "the body's own words"
    waiters = [
        asyncio.create_task(
            client.post(
                gate.url + CHAT,
                json=chat(messages=[{"role": "user", "content": words}]),
                headers={**AUTH, "x-request-id": f"waiter-{n}"},
            )
        )
        for n in range(3)
    ]
    await gate.until(lambda: gate.service.admission.queued == 3)
    answer = await client.get(gate.url + "/admission", headers=AUTH)
    listed = answer.json()["waiting"]
    assert [w["request_id"] for w in listed] == ["waiter-0", "waiter-1", "waiter-2"]
    assert [w["position"] for w in listed] == [1, 2, 3]
    assert all(w["waited_s"] >= 0 and w["eta_s"] >= 0 for w in listed)
    assert KEY not in answer.text
    assert words not in answer.text
    standin.hurry()
    for waiter in waiters:
        assert (await waiter).status_code == 200
    await holder
    assert (await client.get(gate.url + "/admission", headers=AUTH)).json()["waiting"] == []


async def test_with_keys_the_stream_and_the_snapshot_need_one_and_the_page_does_not(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys=(KEY,))
    assert (await client.get(gate.url + "/admission/events")).status_code == 401
    assert (await client.get(gate.url + "/admission")).status_code == 401
    # The page holds no data: it asks for the key itself.
    assert (await client.get(gate.url + "/status")).status_code == 200
    async for snapshot in events(client, gate, **AUTH):
        assert snapshot["capacity"] == 2
        break


@pytest.mark.parametrize("path", sorted(FILES))
async def test_the_page_runs_only_its_own_script_and_style_and_never_in_a_frame(
    start_gate: GateFactory, client: httpx.AsyncClient, path: str
) -> None:
    gate = await start_gate()
    answer = await client.get(gate.url + path)
    assert answer.status_code == 200
    policy = answer.headers["content-security-policy"]
    assert "script-src 'self'" in policy
    assert "style-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy
    assert "unsafe-inline" not in policy
    assert answer.headers["x-frame-options"] == "DENY"
    assert answer.headers["x-content-type-options"] == "nosniff"
    # Nothing loaded from elsewhere.
    for remote in ('src="http', 'href="http', "url(http", "import("):
        assert remote not in answer.text
    assert "<script>" not in answer.text
    assert " style=" not in answer.text


async def test_admission_and_its_stream_allow_the_origins_llama_server_allows(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.cors_origins = {"https://ops.example"}
    gate = await start_gate()
    origin = {"origin": "https://ops.example"}
    before = await client.get(gate.url + "/admission", headers=origin)
    assert "access-control-allow-origin" not in before.headers
    # A generation from that Origin teaches slotgate llama-server's answer to it.
    assert (await client.post(gate.url + CHAT, json=chat(), headers=origin)).status_code == 200
    after = await client.get(gate.url + "/admission", headers=origin)
    assert after.headers["access-control-allow-origin"] == "https://ops.example"
    preflight = await client.options(
        gate.url + "/admission/events",
        headers={**origin, "access-control-request-method": "GET",
                 "access-control-request-headers": "authorization"},
    )  # fmt: skip
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "https://ops.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    other = await client.get(gate.url + "/admission", headers={"origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    async with client.stream("GET", gate.url + "/admission/events", headers=origin) as stream:
        assert stream.headers["access-control-allow-origin"] == "https://ops.example"


async def test_a_held_slot_shows_in_the_stream_within_a_tick(
    one_slot_held: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held()
    async for snapshot in events(client, gate):
        if snapshot["active"] == 1:
            assert snapshot["upstreams"][0]["active"] == 1
            break


ADMIN = "sk-status-admin-key"


async def test_with_admin_keys_an_operator_reads_the_data_with_the_admin_key(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(admin_keys=(ADMIN,))
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert (await client.get(gate.url + "/admission")).status_code == 401
    assert (await client.get(gate.url + "/admission/events")).status_code == 401
    # An admin key is an operator's, sent as a Bearer token only.
    assert (
        await client.get(gate.url + "/admission", headers={"x-api-key": ADMIN})
    ).status_code == 401
    assert (await client.get(gate.url + "/admission", headers=admin)).status_code == 200
    async for snapshot in events(client, gate, **admin):
        assert snapshot["capacity"] == 2
        break


async def test_with_both_kinds_of_key_either_reads_the_data(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys=(KEY,), admin_keys=(ADMIN,))
    for key in (KEY, ADMIN):
        answer = await client.get(
            gate.url + "/admission", headers={"authorization": f"Bearer {key}"}
        )
        assert answer.status_code == 200
    wrong = {"authorization": "Bearer sk-neither"}
    assert (await client.get(gate.url + "/admission", headers=wrong)).status_code == 401


async def test_a_waiter_in_a_models_line_is_listed_with_its_model_and_its_lines_eta(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream, child = await slow_model(router)
    gate = await gate_before(upstream)
    alpha = line(gate, "alpha")
    # Its line expects long holds; the gate's main line (no slots of its own) knows nothing.
    alpha.admission.expect(120.0)
    started = asyncio.Event()
    holder = asyncio.create_task(
        hold_stream_of(client, gate, chat(model="alpha", stream=True), started)
    )
    await started.wait()
    waiter = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(model="alpha"), headers={"x-request-id": "w-a"})
    )
    await gate.until(lambda: alpha.admission.queued == 1)
    listed = (await client.get(gate.url + "/admission")).json()["waiting"]
    assert [(w["request_id"], w["model"], w["position"]) for w in listed] == [("w-a", "alpha", 1)]
    assert listed[0]["eta_s"] == pytest.approx(alpha.admission.eta_s(1), abs=5)
    assert listed[0]["eta_s"] > 30  # the gate's own line would say 0
    child.hurry()
    assert (await waiter).status_code == 200
    await holder
