"""slotgate in front of a hostile upstream (tests/support/hostile.py): whatever comes from
llama-server's side, each client gets its own answer or a clear error, and memory stays bounded."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from tests.conftest import (
    CHAT,
    GateFactory,
    answered_after_waiting,
    before_hostile,
    chat,
    error_answered,
    read_stream,
    waiting_before_hostile,
)
from tests.support.hostile import (
    CHAT_STREAM,
    PARTIAL_EVENT,
    SSE_HEAD,
    Hostile,
    MiB,
    Peer,
    Request,
    closes,
    huge_error,
    huge_head,
    reply,
    sends,
    stream,
)


def events(body: bytes) -> list[bytes]:
    """The events of a stream, keep-alive comments left out."""
    assert body.endswith(b"\n\n")
    return [e for e in body[:-2].split(b"\n\n") if not e.startswith(b":")]


def error_of(event: bytes) -> dict[str, Any]:
    assert event.startswith(b"data: {")
    error: dict[str, Any] = json.loads(event[len(b"data: ") :])["error"]
    return error


# -- a connection that sent too much is never reused -----------------------------------------------


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
    gate = await before_hostile(start_gate, hostile)
    first = await client.post(gate.url + "/tokenize", json={"content": "a"})
    assert (first.status_code, first.content) == (200, b'{"n":1}')
    await asyncio.sleep(0.2)
    second = await client.post(gate.url + "/tokenize", json={"content": "b"})
    assert (second.status_code, second.content) == (200, b'{"n":2}')


# -- bounded heads and error bodies ----------------------------------------------------------------


async def test_a_twenty_megabyte_response_head_gets_a_502_in_the_apis_shape(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    hostile.script.append(huge_head(20 * MiB))
    gate = await before_hostile(start_gate, hostile)
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed"
    assert "head is over 65536 bytes" in error["message"]
    assert gate.service.admission.active == 0


async def test_a_huge_head_for_a_waiting_stream_is_an_error_event(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    gate = await waiting_before_hostile(start_gate, hostile)
    last = events(await answered_after_waiting(gate, hostile, client, huge_head(20 * MiB)))[-1]
    assert error_of(last)["code"] == "upstream_failed"
    assert "head is over" in error_of(last)["message"]


async def test_a_huge_error_body_for_a_waiting_stream_becomes_one_short_error_event(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    gate = await waiting_before_hostile(start_gate, hostile)
    body = await answered_after_waiting(gate, hostile, client, huge_error(200 * MiB))
    assert len(body) < 4096  # not the 200 MB, nor the 64 KiB read of it
    error = error_of(events(body)[-1])
    assert error["code"] == "upstream_failed"
    assert "500" in error["message"]
    assert "65536" in error["message"]
    await gate.until(lambda: gate.service.admission.active == 0)


async def test_a_small_error_body_for_a_waiting_stream_is_relayed_as_its_event(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    gate = await waiting_before_hostile(start_gate, hostile)
    refused = {"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}}
    body = await answered_after_waiting(
        gate, hostile, client, sends(reply(400, json.dumps(refused).encode()))
    )
    assert error_of(events(body)[-1]) == refused["error"]


async def test_a_props_answer_over_the_bound_marks_llama_server_not_ready(
    start_gate: GateFactory, hostile: Hostile
) -> None:
    hostile.props = huge_error(200 * MiB, status=200)
    gate = await before_hostile(start_gate, hostile, ready=False)
    await gate.until(lambda: "bytes" in gate.service.upstream.reason)
    assert not gate.service.upstream.ready
    assert hostile.sent < 200 * MiB


# -- an error after a cut starts on an event boundary ----------------------------------------------


@pytest.mark.parametrize("waiting", [False, True], ids=["relayed", "relayed-after-waiting"])
async def test_an_upstream_cut_mid_event_gets_its_error_on_a_new_event_boundary(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient, waiting: bool
) -> None:
    gate = await waiting_before_hostile(start_gate, hostile)
    cut = stream(*CHAT_STREAM[:2], cut=PARTIAL_EVENT)
    if waiting:
        body = await answered_after_waiting(gate, hostile, client, cut)
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
    gate = await before_hostile(start_gate, hostile)
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


# -- 1xx skipped, 101 refused ----------------------------------------------------------------------


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
    gate = await before_hostile(start_gate, hostile)
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
    gate = await before_hostile(start_gate, hostile)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        status, body = await exchange(reader, writer, "/tokenize")
        assert status == 502
        assert json.loads(body)["error"]["code"] == "upstream_failed"
        assert await exchange(reader, writer, "/tokenize") == (200, b'{"n":2}')
    finally:
        writer.close()
        await writer.wait_closed()


# -- an IPv6 upstream ----------------------------------------------------------------------------


async def test_an_ipv6_upstream_gets_its_host_header_in_brackets(start_gate: GateFactory) -> None:
    hostile = Hostile(host="::1")
    try:
        await hostile.start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert hostile.url == f"http://[::1]:{hostile.port}"
        await before_hostile(start_gate, hostile)  # ready: /props was read over IPv6
    finally:
        await hostile.stop()
    assert hostile.requests[0].headers[b"host"] == f"[::1]:{hostile.port}".encode()


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"\x16\x03\x01 this is not http\r\n\r\n", id="garbage-instead-of-http"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"choices": [',
            id="truncated-body",
        ),
    ],
)
async def test_an_answer_that_is_no_http_or_cut_short_gets_502_and_frees_the_slot(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient, sent: bytes
) -> None:
    hostile.fallback = closes(sends(sent))
    gate = await start_gate(llama_server_url=hostile.url)
    assert (await error_answered(client, gate, 502))["code"] == "upstream_failed"


async def test_upstream_trickling_byte_by_byte_is_relayed_intact(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    events = b'data: {"choices":[{"delta":{"content":"slow"}}]}\n\ndata: [DONE]\n\n'
    trickle: list[bytes | float] = []
    for byte in events:
        trickle += [b"1\r\n%b\r\n" % bytes([byte]), 0.001]
    hostile.fallback = closes(
        sends(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n", *trickle, b"0\r\n\r\n")
    )  # fmt: skip
    gate = await start_gate(llama_server_url=hostile.url)
    response = await client.post(gate.url + CHAT, json=chat(stream=True))
    assert response.status_code == 200
    assert response.content == events
    assert gate.service.admission.active == 0
