"""Tenants through the whole gate, in front of the stand-in: fair share, limits, reloads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import (
    CHAT,
    TENANTS,
    GateFactory,
    RunningGate,
    cancel_all,
    chat,
    write_keys,
)
from tests.support.standin import StandIn

NEW = '\n[tenants.new]\nkey = "sk-new"\n'


def rewrite(path: Path, text: str) -> None:
    path.write_text(text)


def bearer(key: str, **headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **headers}


def said(text: str) -> dict[str, Any]:
    """A chat request whose prompt names it, to find it among what the stand-in saw."""
    return {"messages": [{"role": "user", "content": text}], "stream": False}


def order_seen(standin: StandIn) -> list[str]:
    return [json.loads(seen.body)["messages"][0]["content"] for seen in standin.seen]


async def queued(client: httpx.AsyncClient, gate: RunningGate, name: str) -> int:
    snapshot = (await client.get(gate.url + "/admission", headers=bearer("sk-chat"))).json()
    [tenant] = [t for t in snapshot["tenants"] if t["name"] == name]
    count: int = tenant["queued"]
    return count


@contextlib.asynccontextmanager
async def flooding(
    client: httpx.AsyncClient, gate: RunningGate, count: int, key: str, **headers: str
) -> AsyncIterator[list[asyncio.Task[httpx.Response]]]:
    """`count` requests sent at once with `key`, all in line or running; left at the end."""
    tasks = [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=said(f"flood {n}"), headers=bearer(key, **headers))
        )
        for n in range(count)
    ]
    await gate.until(lambda: gate.service.admission.queued >= count - 2)
    try:
        yield tasks
    finally:
        await cancel_all(tasks)


async def test_an_interactive_key_is_served_next_although_another_keys_flood_waits(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, keys_file: Path
) -> None:
    standin.tokens, standin.token_delay_s = 10, 0.02
    gate = await start_gate(api_keys_file=keys_file, max_queue=0)
    async with flooding(client, gate, 300, "sk-flood"):
        for n in range(3):
            # Arrives behind about 300 of the flood; the next slot that frees is its own.
            started_before = len(standin.seen)
            answer = await client.post(
                gate.url + CHAT, json=said(f"chat {n}"), headers=bearer("sk-chat")
            )
            assert answer.status_code == 200
            flood_first = order_seen(standin)[started_before:].index(f"chat {n}")
            assert flood_first <= standin.total_slots, order_seen(standin)[started_before:]
        assert await queued(client, gate, "flood") > 250


async def test_a_request_lowered_by_x_priority_yields_to_the_same_keys_chat(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, keys_file: Path
) -> None:
    standin.tokens, standin.token_delay_s = 10, 0.02
    gate = await start_gate(api_keys_file=keys_file, max_queue=0)
    async with flooding(client, gate, 40, "sk-chat", **{"x-priority": "batch"}):
        started_before = len(standin.seen)
        answer = await client.post(gate.url + CHAT, json=said("now"), headers=bearer("sk-chat"))
        assert answer.status_code == 200
        assert order_seen(standin)[started_before:].index("now") <= standin.total_slots
        # Asking for a higher band than the key's does nothing: the flood's own band.
        assert await queued(client, gate, "chat") > 30


async def test_a_tenant_at_max_queued_is_refused_429_while_others_get_in(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    keys_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 20, 0.02
    gate = await start_gate(api_keys_file=keys_file, log_level="info")
    jobs = [
        asyncio.create_task(client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-jobs")))
        for _ in range(3)
    ]
    await gate.until(lambda: gate.service.admission.tenant_counts("jobs") == (1, 2))
    caplog.set_level(logging.INFO, logger="slotgate.access")
    refused = await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-jobs"))
    other = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-chat"))
    )
    await gate.until(lambda: gate.service.admission.tenant_counts("chat")[1] == 1)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "tenant_queue_full"
    assert error["admission"]["tenant"] == {"name": "jobs", "active": 1, "queued": 2}
    assert error["admission"]["queued"] == 2
    assert int(refused.headers["retry-after"]) >= 1
    assert "sk-jobs" not in refused.text
    standin.hurry()
    assert (await other).status_code == 200
    assert [r.status_code for r in await asyncio.gather(*jobs)] == [200, 200, 200]
    lines = [r for r in caplog.records if r.name == "slotgate.access"]
    assert {(r.tenant, r.outcome) for r in lines} >= {  # type: ignore[attr-defined]
        ("jobs", "tenant_queue_full"),
        ("chat", "served"),
    }
    metrics = (await client.get(gate.url + "/metrics", headers=bearer("sk-chat"))).text
    assert 'reason="tenant_queue_full"' in metrics


async def test_admission_lists_tenants_by_name_and_never_their_keys(
    start_gate: GateFactory, client: httpx.AsyncClient, keys_file: Path
) -> None:
    gate = await start_gate(api_keys_file=keys_file, api_keys="sk-extra")
    answer = await client.get(gate.url + "/admission", headers=bearer("sk-extra"))
    tenants = answer.json()["tenants"]
    assert [t["name"] for t in tenants][:3] == ["flood", "chat", "jobs"]
    assert tenants[2] == {
        "name": "jobs", "band": 1, "weight": 1.0, "max_active": None, "max_queued": 2,
        "active": 0, "queued": 0, "slot_seconds_share_1m": 0.0,
    }  # fmt: skip
    assert tenants[3]["name"].startswith("key-")
    assert "sk-" not in answer.text
    unknown = await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-nobody"))
    assert unknown.status_code == 401


async def test_a_reload_under_load_loses_nothing_and_a_bad_one_is_refused(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, keys_file: Path
) -> None:
    standin.tokens, standin.token_delay_s = 5, 0.01
    gate = await start_gate(api_keys_file=keys_file, max_queue=0)

    async def one(key: str) -> int:
        answer = await client.post(gate.url + CHAT, json=chat(), headers=bearer(key))
        return answer.status_code

    load = [asyncio.create_task(one(k)) for k in ("sk-flood", "sk-chat") * 40]
    await gate.until(lambda: gate.service.admission.queued > 20)
    rewrite(keys_file, TENANTS.replace('key = "sk-chat"', 'key = "sk-chat"\nweight = 4'))
    rewrite(keys_file, TENANTS.replace('key = "sk-chat"', 'key = "sk-chat"\nweight = 4') + NEW)
    os.kill(os.getpid(), signal.SIGHUP)
    await gate.until(lambda: len(gate.service.access.tenants.roster.tenants) == 4)
    load += [asyncio.create_task(one("sk-new")) for _ in range(5)]
    rewrite(keys_file, "[tenants.broken\n")
    os.kill(os.getpid(), signal.SIGHUP)
    load += [asyncio.create_task(one(k)) for k in ("sk-new", "sk-chat") * 5]
    assert set(await asyncio.gather(*load)) == {200}
    assert gate.service.admission.queued == 0
    by_name = {t.name: t for t in gate.service.access.tenants.roster.tenants}
    assert by_name["chat"].weight == 4


async def test_admission_shows_each_tenants_share_of_the_slot_seconds_over_the_last_minute(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, keys_file: Path
) -> None:
    standin.tokens, standin.token_delay_s = 4, 0.02
    gate = await start_gate(api_keys_file=keys_file)
    await asyncio.gather(
        *(client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-flood")) for _ in range(3)),
        client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-chat")),
    )
    answer = await client.get(gate.url + "/admission", headers=bearer("sk-chat"))
    shares = {t["name"]: t["slot_seconds_share_1m"] for t in answer.json()["tenants"]}
    # Four generations of about the same length, three of them the flood's.
    assert shares["flood"] == pytest.approx(0.75, abs=0.15)
    assert shares["chat"] == pytest.approx(0.25, abs=0.15)
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.001)


async def test_a_request_asking_more_slots_than_its_tenants_max_active_is_refused_400(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    standin.total_slots = 4
    path = write_keys(tmp_path, '[tenants.capped]\nkey = "sk-capped"\nmax_active = 1\n')
    gate = await start_gate(api_keys_file=path)
    asked = {**chat(), "n": 2}
    refused = await client.post(gate.url + CHAT, json=asked, headers=bearer("sk-capped"))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "too_many_slots"
    assert error["type"] == "invalid_request_error"
    assert "max_active=1" in error["message"]
    assert standin.max_running == 0  # never sent
    one = await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-capped"))
    assert one.status_code == 200
