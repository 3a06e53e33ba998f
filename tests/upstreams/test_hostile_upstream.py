"""slotgate in front of a hostile upstream (tests/support/hostile.py): whatever comes from
llama-server's side, each client gets its own answer or a clear error, and memory stays bounded."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from tests.conftest import GateFactory, RunningGate, chat
from tests.support.hostile import (
    CHAT_STREAM,
    PARTIAL_EVENT,
    SSE_HEAD,
    Hostile,
    MiB,
    Peer,
    Request,
    held,
    huge_error,
    huge_head,
    reply,
    sends,
    stream,
)

CHAT = "/v1/chat/completions"


async def gate_before(start_gate: GateFactory, hostile: Hostile, **overrides: Any) -> RunningGate:
    # /props read once, at the start: a poll in the middle of a test would take pooled
    # connections the test is watching.
    values: dict[str, Any] = {"props_refresh_interval_s": 60, **overrides}
    gate: RunningGate = await start_gate(llama_server_url=hostile.url, **values)
    return gate


async def read_stream(client: httpx.AsyncClient, url: str) -> bytes:
    async with client.stream("POST", url, json=chat(stream=True)) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_raw()])


def events(body: bytes) -> list[bytes]:
    """The events of a stream, keep-alive comments left out."""
    assert body.endswith(b"\n\n")
    return [e for e in body[:-2].split(b"\n\n") if not e.startswith(b":")]


def error_of(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: {")
    error: dict[str, Any] = json.loads(event[len(b"data: ") :])["error"]
    return error


async def waiting_behind_a_held_slot(
    gate: RunningGate, hostile: Hostile, client: httpx.AsyncClient
) -> tuple[asyncio.Event, asyncio.Task[bytes], asyncio.Task[bytes]]:
    """The only slot held by a stream the upstream answers on release; a second stream waits
    in line, its 200 head already out (STREAM_HEAD_AFTER_S=0). Returns (release, holder, waiter)."""
    release = asyncio.Event()
    hostile.script.append(held(release, stream(*CHAT_STREAM)))
    holder = asyncio.create_task(read_stream(client, gate.url + CHAT))
    await gate.until(lambda: len(hostile.served()) == 1)
    waiter = asyncio.create_task(read_stream(client, gate.url + CHAT))
    await gate.until(lambda: gate.service.admission.queued == 1)
    return release, holder, waiter


# -- item 4: a connection that sent too much is never reused ------------------------------------


@pytest.mark.parametrize(
    "surplus",
    [
        sends(reply(200, b'{"n":1}') + reply(200, b'{"n":"extra"}')),
        sends(reply(200, b'{"n":1}'), 0.05, reply(200, b'{"n":"extra"}')),
    ],
    ids=["in-the-same-write", "while-idle"],
)
async def test_a_response_too_many_never_reaches_the_next_client(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient, surplus: Any
) -> None:
    hostile.script.append(surplus)
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    gate = await gate_before(start_gate, hostile)
    first = await client.post(gate.url + "/tokenize", json={"content": "a"})
    assert (first.status_code, first.content) == (200, b'{"n":1}')
    await asyncio.sleep(0.2)
    second = await client.post(gate.url + "/tokenize", json={"content": "b"})
    assert (second.status_code, second.content) == (200, b'{"n":2}')


# -- item 5: bounded heads and error bodies -----------------------------------------------------


async def test_a_twenty_megabyte_response_head_gets_a_502_in_the_apis_shape(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    hostile.script.append(huge_head(20 * MiB))
    gate = await gate_before(start_gate, hostile)
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed"
    assert "head is over 65536 bytes" in error["message"]
    assert gate.service.admission.active == 0


async def test_a_huge_head_for_a_waiting_stream_is_an_error_event(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    gate = await gate_before(start_gate, hostile, keepalive_interval_s=1, stream_head_after_s=0)
    release, holder, waiter = await waiting_behind_a_held_slot(gate, hostile, client)
    hostile.script.append(huge_head(20 * MiB))
    release.set()
    await holder
    last = events(await waiter)[-1]
    assert error_of(last)["code"] == "upstream_failed"
    assert "head is over" in error_of(last)["message"]


async def test_a_huge_error_body_for_a_waiting_stream_becomes_one_short_error_event(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    gate = await gate_before(start_gate, hostile, keepalive_interval_s=1, stream_head_after_s=0)
    release, holder, waiter = await waiting_behind_a_held_slot(gate, hostile, client)
    hostile.script.append(huge_error(200 * MiB))
    release.set()
    await holder
    body = await waiter
    assert len(body) < 4096  # not the 200 MB, nor the 64 KiB read of it
    error = error_of(events(body)[-1])
    assert error["code"] == "upstream_failed"
    assert "500" in error["message"]
    assert "65536" in error["message"]
    await gate.until(lambda: gate.service.admission.active == 0)


async def test_a_small_error_body_for_a_waiting_stream_is_relayed_as_its_event(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    gate = await gate_before(start_gate, hostile, keepalive_interval_s=1, stream_head_after_s=0)
    release, holder, waiter = await waiting_behind_a_held_slot(gate, hostile, client)
    refused = {"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}}
    hostile.script.append(sends(reply(400, json.dumps(refused).encode())))
    release.set()
    await holder
    assert error_of(events(await waiter)[-1]) == refused["error"]


async def test_a_props_answer_over_the_bound_marks_llama_server_not_ready(
    start_gate: GateFactory, hostile: Hostile
) -> None:
    hostile.props = huge_error(200 * MiB, status=200)
    gate = await gate_before(start_gate, hostile, ready=False)
    await gate.until(lambda: "bytes" in gate.service.upstream.reason)
    assert not gate.service.upstream.ready
    assert hostile.sent < 200 * MiB


# -- item 9: an error after a cut starts on an event boundary -----------------------------------


@pytest.mark.parametrize("waiting", [False, True], ids=["relayed", "relayed-after-waiting"])
async def test_an_upstream_cut_mid_event_gets_its_error_on_a_new_event_boundary(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient, waiting: bool
) -> None:
    gate = await gate_before(start_gate, hostile, keepalive_interval_s=1, stream_head_after_s=0)
    cut = stream(*CHAT_STREAM[:2], cut=PARTIAL_EVENT)
    if waiting:
        release, holder, waiter = await waiting_behind_a_held_slot(gate, hostile, client)
        hostile.script.append(cut)
        release.set()
        await holder
        body = await waiter
    else:
        hostile.script.append(cut)
        body = await read_stream(client, gate.url + CHAT)
    assert b"data: data:" not in body
    *_, partial, last = events(body)
    assert partial == PARTIAL_EVENT  # relayed as it came; the error follows it, apart
    assert error_of(last)["code"] == "upstream_failed"


async def test_a_stream_cut_by_shutdown_mid_event_ends_with_its_error_on_a_new_boundary(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    async def endless(peer: Peer, _: Request) -> None:
        await peer.write(SSE_HEAD + b"%x\r\n%b\r\n" % (len(PARTIAL_EVENT), PARTIAL_EVENT))
        await asyncio.Event().wait()  # nothing more, until slotgate's drain timeout cuts it

    hostile.script.append(endless)
    gate = await gate_before(start_gate, hostile)
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        chunks = response.aiter_raw()
        body = await anext(chunks)
        stopping = asyncio.create_task(gate.stop())
        body += b"".join([chunk async for chunk in chunks])
        await stopping
    assert b"data: data:" not in body
    *_, partial, last = events(body)
    assert partial == PARTIAL_EVENT
    assert error_of(last)["code"] == "shutting_down"


# -- item 10: 1xx skipped, 101 refused -----------------------------------------------------------


async def test_interim_answers_are_skipped_and_the_final_one_relayed(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    hostile.script.append(
        sends(
            b"HTTP/1.1 100 Continue\r\n\r\n",
            0.05,  # each head read on its own
            b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n",
            0.05,
            reply(200, b'{"n":1}'),
        )
    )
    hostile.script.append(
        sends(
            b"HTTP/1.1 100 Continue\r\n\r\n",
            0.05,
            SSE_HEAD,
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(CHAT_STREAM[1]), CHAT_STREAM[1]),
        )
    )
    gate = await gate_before(start_gate, hostile)
    plain = await client.post(gate.url + "/tokenize", json={"content": "a"})
    assert (plain.status_code, plain.content) == (200, b'{"n":1}')
    assert "link" not in plain.headers  # the interim answer's headers are not the answer's
    assert await read_stream(client, gate.url + CHAT) == CHAT_STREAM[1]


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str
) -> tuple[int, bytes]:
    """One request on a kept-alive connection to slotgate."""
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: slotgate\r\nContent-Type: application/json\r\n"
        f"Content-Length: 2\r\n\r\n{{}}".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length is not None
    return int(head.split(b" ", 2)[1]), await reader.readexactly(int(length[1]))


async def test_a_switching_protocols_answer_is_a_502_and_the_clients_connection_lives_on(
    start_gate: GateFactory, hostile: Hostile
) -> None:
    hostile.script.append(sends(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nraw"))
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    gate = await gate_before(start_gate, hostile)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        status, body = await exchange(reader, writer, "/tokenize")
        assert status == 502
        assert json.loads(body)["error"]["code"] == "upstream_failed"
        assert await exchange(reader, writer, "/tokenize") == (200, b'{"n":2}')
    finally:
        writer.close()
        await writer.wait_closed()


# -- issue 15: an IPv6 upstream ------------------------------------------------------------------


async def test_an_ipv6_upstream_gets_its_host_header_in_brackets(start_gate: GateFactory) -> None:
    hostile = Hostile(host="::1")
    try:
        await hostile.start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert hostile.url == f"http://[::1]:{hostile.port}"
        await gate_before(start_gate, hostile)  # ready: /props was read over IPv6
    finally:
        await hostile.stop()
    assert hostile.requests[0].headers[b"host"] == f"[::1]:{hostile.port}".encode()
