"""The upstream HTTP/1.1 client on its own, against the stand-in llama-server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable

import pytest
import uvloop
from slotgate import client as client_module
from slotgate.client import Client, ConnectFailed

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


async def test_a_whole_body_read_wakes_at_its_end_and_stalls_only_on_silence(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 tokens 0.1 s apart: 0.8 s in all, longer than the stall timeout, no gap as long.
    standin.tokens, standin.token_delay_s = 8, 0.1
    client = Client("127.0.0.1", standin.port, tls=False, connect_timeout_s=2, keepalive_s=4,
                    stall_s=0.3)  # fmt: skip
    waits = 0
    real_wait = client_module._Connection.wait

    async def counted(conn: client_module._Connection, stall_s: float | None) -> None:
        nonlocal waits
        waits += 1
        await real_wait(conn, stall_s)

    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    monkeypatch.setattr(client_module._Connection, "wait", counted)
    data = await response.read()
    assert data.count(b"data: ") == 8 + 3  # role, 8 tokens, finish, [DONE]
    assert waits <= 2  # not one per chunk (11 events)
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


async def verdict(client: Client) -> bool | None:
    """What the client learned of the upstream from its first stream, once it has."""
    async with asyncio.timeout(5):
        while client.streams_kept is None:
            await asyncio.sleep(0.01)
    return client.streams_kept


async def test_an_upstream_that_closes_after_streams_never_gets_a_stream_connection_reused(
    standin: StandIn,
) -> None:
    standin.tokens, standin.token_delay_s = 2, 0  # the stand-in closes, as llama-server does
    client = client_for(standin)
    await stream(client)
    assert await verdict(client) is False
    for _ in range(5):  # each right after the last: a reused connection would be dead
        following = await stream(client)
        assert following._conn not in client._idle
    client.close()


async def test_an_upstream_that_keeps_connections_after_streams_gets_them_reused(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "STREAM_PROBE_S", 0.05)
    standin.tokens, standin.token_delay_s, standin.close_after_stream = 2, 0, False
    client = client_for(standin)
    probed = await stream(client)
    assert probed._conn not in client._idle  # held aside while the client learns
    assert await verdict(client) is True
    kept = probed._conn
    for _ in range(5):
        assert client._idle[-1] is kept
        assert (await stream(client))._conn is kept  # the same connection, every time
    client.close()


async def test_an_upstream_that_starts_closing_after_streams_revokes_the_verdict(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "STREAM_PROBE_S", 0.05)
    standin.tokens, standin.token_delay_s, standin.close_after_stream = 2, 0, False
    client = client_for(standin)
    await stream(client)
    assert await verdict(client) is True
    standin.close_after_stream = True  # as if restarted as a llama-server build
    await stream(client)
    await asyncio.sleep(0.05)  # its close arrives while the connection sits in the pool
    following = await client.request("GET", "/props", [], b"")
    await following.read()
    following.release()
    assert client.streams_kept is False
    client.close()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_close_the_loop_has_not_read_yet_is_seen_in_the_kernel(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # After a stall uvloop runs due timers before it reads sockets: the probe's verdict must
    # not depend on whether the loop has noticed the upstream's close yet.
    async def scenario() -> tuple[bool, bool]:
        server_side: list[asyncio.StreamWriter] = []

        async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            server_side.append(writer)

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = Client("127.0.0.1", port, tls=False, connect_timeout_s=2, keepalive_s=4,
                        stall_s=5)  # fmt: skip
        open_conn, closed_conn = await client._connect(), await client._connect()
        async with asyncio.timeout(5):
            while len(server_side) < 2:
                await asyncio.sleep(0.01)
        # A FIN now, from the kernel, not at the server loop's next turn.
        fd = server_side[1].get_extra_info("socket").fileno()
        with socket.socket(fileno=os.dup(fd)) as raw:
            raw.shutdown(socket.SHUT_WR)
        time.sleep(0.2)  # noqa: ASYNC251 - the loop stalls: the FIN is in, the protocol unaware
        seen = (client_module._peer_closed(open_conn), client_module._peer_closed(closed_conn))
        assert closed_conn.transport is not None  # the loop had indeed not read it yet
        for conn in (open_conn, closed_conn):
            conn.close()
        for writer in server_side:
            writer.close()
            await writer.wait_closed()
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.05)  # the client's transports finish closing
        return seen

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(scenario()) == (False, True)


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_probe_that_outlives_a_stall_still_sees_the_upstream_close(
    loop_factory: Callable[[], asyncio.AbstractEventLoop], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "STREAM_PROBE_S", 0.05)

    async def scenario() -> tuple[bool | None, int]:
        standin = StandIn(tokens=2, token_delay_s=0)  # closes after a stream
        await standin.start()
        client = client_for(standin)
        try:
            await stream(client)  # released before the upstream's close is read...
            time.sleep(0.2)  # noqa: ASYNC251 - ...then the loop stalls past the probe's end
            await asyncio.sleep(0.1)
            verdict = client.streams_kept
            for _ in range(5):  # a connection pooled by a wrong verdict would fail these
                await stream(client)
            return verdict, standin.finished
        finally:
            client.close()
            await standin.stop()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(scenario()) == (False, 6)
