"""The HTTP protocol slotgate runs uvicorn with: a bound on request heads, on real sockets."""

from __future__ import annotations

import asyncio
import json

import httpx

from app.protocol import HEAD_LIMIT_BYTES
from tests.conftest import GateFactory, chat
from tests.standin import StandIn

CHAT = "/v1/chat/completions"


async def test_a_head_that_never_ends_is_cut_off_with_431_past_the_limit(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Big: ")
    piece = b"a" * 65536
    outcome = "still taking bytes"
    try:
        for _ in range(2 * HEAD_LIMIT_BYTES // len(piece)):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0)
        answer = await asyncio.wait_for(reader.read(65536), 5)
        if answer.startswith(b"HTTP/1.1 431 "):
            outcome = "431"
            body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert body["error"]["code"] == "headers_too_large"
        elif answer == b"":
            outcome = "closed"
    except (ConnectionResetError, BrokenPipeError):
        outcome = "closed"  # the 431 and the close raced the last pieces
    except TimeoutError:
        pass
    finally:
        writer.close()
    assert outcome in ("431", "closed")
    assert standin.seen == []
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200


async def test_a_body_larger_than_the_head_limit_is_not_taken_for_a_head(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(max_body_bytes=4 * HEAD_LIMIT_BYTES)
    response = await client.post(gate.url + CHAT, json=chat(padding="x" * 2 * HEAD_LIMIT_BYTES))
    assert response.status_code == 200
    assert len(standin.seen[-1].body) > 2 * HEAD_LIMIT_BYTES
