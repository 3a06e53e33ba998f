"""The upstream HTTP/1.1 client on its own, against the stand-in llama-server."""

from __future__ import annotations

import asyncio
import json

import pytest

from app import client as client_module
from app.client import Client, ConnectFailed
from tests.standin import StandIn


def client_for(standin: StandIn, keepalive_s: float = 4.0) -> Client:
    return Client(
        "127.0.0.1", standin.port, tls=False, connect_timeout_s=2, keepalive_s=keepalive_s,
        stall_s=5,
    )  # fmt: skip


async def test_sequential_requests_reuse_one_connection(standin: StandIn) -> None:
    client = client_for(standin)
    for _ in range(5):
        response = await client.request("GET", "/props", [], b"")
        assert json.loads(await response.read())["total_slots"] == 2
        response.release()
    assert standin.connections() == 1
    client.close()


async def test_an_idle_connection_older_than_the_keepalive_is_not_reused(
    standin: StandIn,
) -> None:
    client = client_for(standin, keepalive_s=0.05)
    first = await client.request("GET", "/props", [], b"")
    await first.read()
    first.release()
    await asyncio.sleep(0.1)
    second = await client.request("GET", "/props", [], b"")
    await second.read()
    second.release()
    await asyncio.sleep(0.05)
    assert standin.connections() == 1  # the stale one was closed, the fresh one kept
    client.close()


async def test_an_abandoned_response_closes_its_connection(standin: StandIn) -> None:
    standin.tokens, standin.token_delay_s = 100, 0.02
    client = client_for(standin)
    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    assert response.status == 200
    assert response.content_type == "text/event-stream"
    assert b"data: " in await response.readany()
    response.close()
    async with asyncio.timeout(5):
        while standin.cancelled == 0:
            await asyncio.sleep(0.01)
    assert standin.connections() == 0
    client.close()


async def test_a_chunked_stream_is_decoded_to_its_events(standin: StandIn) -> None:
    client = client_for(standin)
    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    data = await response.read()
    assert data.endswith(b"data: [DONE]\n\n")
    assert b"\r\n" not in data  # no chunk framing left in the body
    response.release()
    client.close()


async def test_a_head_request_has_no_body_to_wait_for(standin: StandIn) -> None:
    client = client_for(standin)
    response = await client.request("HEAD", "/props", [], b"")
    assert response.status in (200, 405)
    async with asyncio.timeout(2):
        assert await response.read() == b""
    response.release()
    client.close()


async def test_nobody_listening_is_a_connect_failure_and_a_reason_to_learn_afresh() -> None:
    standin = StandIn()
    await standin.start()
    port = standin.port
    await standin.stop()
    client = Client("127.0.0.1", port, tls=False, connect_timeout_s=2, keepalive_s=4, stall_s=5)
    client.streams_kept = True  # learned from the server that has now gone
    with pytest.raises(ConnectFailed):
        await client.request("GET", "/props", [], b"")
    assert client.streams_kept is None  # whatever answers next may be another build


async def test_after_a_stream_a_replacement_connection_is_opened_ahead_of_need(
    standin: StandIn,
) -> None:
    standin.tokens, standin.token_delay_s = 2, 0
    client = client_for(standin)
    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    await response.read()
    response.release()  # an event stream's connection is held aside for the first streams...
    async with asyncio.timeout(5):
        while not client._idle:  # ...and a fresh one is made ready for the next request
            await asyncio.sleep(0.01)
    warm = client._idle[0]
    following = await client.request("GET", "/props", [], b"")
    assert following._conn is warm
    await following.read()
    following.release()
    client.close()


async def stream(client: Client) -> client_module.Response:
    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    assert (await response.read()).endswith(b"data: [DONE]\n\n")
    response.release()
    return response


async def test_an_upstream_that_closes_after_streams_never_gets_a_stream_connection_reused(
    standin: StandIn,
) -> None:
    standin.tokens, standin.token_delay_s, standin.close_after_stream = 2, 0, True
    client = client_for(standin)
    first = await stream(client)
    async with asyncio.timeout(5):
        while client.streams_kept is None:
            await asyncio.sleep(0.01)
    assert client.streams_kept is False
    for _ in range(5):  # each right after the last: a reused connection would be dead
        following = await stream(client)
        assert following._conn is not first._conn
        assert following._conn not in client._idle
    client.close()


async def test_an_upstream_that_keeps_connections_after_streams_gets_them_reused(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "STREAM_PROBE_S", 0.05)
    standin.tokens, standin.token_delay_s = 2, 0
    client = client_for(standin)
    probed = await stream(client)
    assert probed._conn not in client._idle  # held aside while the client learns
    async with asyncio.timeout(5):
        while client.streams_kept is None:
            await asyncio.sleep(0.01)
    assert client.streams_kept is True
    assert probed._conn in client._idle
    opened = standin.connections()
    for _ in range(5):
        await stream(client)
    assert standin.connections() == opened  # no new connection for any of them
    client.close()
