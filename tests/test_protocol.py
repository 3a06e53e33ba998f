"""The HTTP protocol slotgate runs uvicorn with: a bound on request heads, on real sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
from slotgate.protocol import HEAD_LIMIT_BYTES

from tests.conftest import GateFactory, chat
from tests.standin import StandIn

CHAT = "/v1/chat/completions"


async def send_then_read(port: int, start: bytes, endless: bytes) -> bytes:
    """Send `start`, then `endless` repeated to twice the limit, then read the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(start)
        for _ in range(2 * HEAD_LIMIT_BYTES // len(endless)):
            writer.write(endless)
            await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def assert_431(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ")
    assert json.loads(body)["error"]["code"] == "headers_too_large"


async def test_a_head_that_never_ends_is_answered_431_past_the_limit(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    start = b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Big: "
    assert_431(await send_then_read(gate.port, start, b"a" * 65536))
    assert standin.seen == []
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200


async def test_trailers_that_never_end_are_answered_431_too(
    start_gate: GateFactory, standin: StandIn
) -> None:
    gate = await start_gate()
    body = json.dumps(chat()).encode()
    start = (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\nX-Big: "
        % (CHAT.encode(), len(body), body)
    )
    assert_431(await send_then_read(gate.port, start, b"a" * 65536))
    assert standin.seen == []


async def test_a_body_larger_than_the_head_limit_is_not_taken_for_a_head(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(max_body_bytes=4 * HEAD_LIMIT_BYTES)
    for chunked in (False, True):
        payload = json.dumps(chat(padding="x" * 2 * HEAD_LIMIT_BYTES)).encode()

        async def pieces(payload: bytes = payload) -> AsyncIterator[bytes]:
            for at in range(0, len(payload), 65536):
                yield payload[at : at + 65536]

        response = await client.post(
            gate.url + CHAT,
            content=pieces() if chunked else payload,  # an iterator goes chunked
            headers={"Content-Type": "application/json"},
        )
        assert response.status_code == 200, chunked
        assert len(standin.seen[-1].body) > 2 * HEAD_LIMIT_BYTES


async def test_pipelined_requests_with_large_bodies_are_all_answered(
    start_gate: GateFactory, standin: StandIn
) -> None:
    # Reads that end one request and begin the next count whole against the next head.
    gate = await start_gate(max_body_bytes=4 * HEAD_LIMIT_BYTES)
    body = json.dumps({"padding": "x" * 200_000}).encode()
    one = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        b"p" * 6000,
        len(body),
        body,
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(one * 20)
    await writer.drain()
    statuses = []
    for _ in range(20):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        statuses.append(head.split(b" ", 2)[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
    writer.close()
    assert statuses == [b"200"] * 20
