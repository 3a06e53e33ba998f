"""The upstream HTTP/1.1 client on its own, against the stand-in llama-server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import tracemalloc
from collections.abc import Callable

import pytest
import uvloop
from slotgate.errors import BodyTooLarge, ConnectFailed, ProtocolError, Stalled
from slotgate.upstreams import client as client_module
from slotgate.upstreams import connection as connection_module
from slotgate.upstreams import reuse as reuse_module
from slotgate.upstreams.connection import Connection, State
from slotgate.upstreams.reuse import UpstreamClient as Client

from tests.support.hostile import Hostile, MiB, Peer, Request, huge_error, huge_head, reply, sends
from tests.support.standin import StandIn


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


async def test_a_connection_goes_new_active_idle_closed_and_its_repr_says_which(
    standin: StandIn,
) -> None:
    assert Connection().state is State.NEW
    client = client_for(standin)
    response = await client.request("GET", "/props", [], b"")
    conn = response._conn
    assert conn.state is State.ACTIVE
    assert repr(conn).startswith("<Connection [ACTIVE status=200")
    await response.read()
    response.release()
    assert conn.is_idle()
    assert repr(conn) == "<Connection [IDLE]>"
    now = time.monotonic()
    assert not conn.has_expired(now, 4.0)
    assert conn.has_expired(now + 5.0, 4.0)  # pooled longer than the keep-alive
    client.close()
    assert repr(conn) == "<Connection [CLOSED]>"
    assert conn.has_expired(now, 4.0)


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


@pytest.mark.interpreted
async def test_a_whole_body_read_wakes_at_its_end_and_stalls_only_on_silence(
    standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 tokens 0.1 s apart: 0.8 s in all, longer than the stall timeout, no gap near as long
    # (half a second to spare for a loaded machine's pause).
    standin.tokens, standin.token_delay_s = 8, 0.1
    client = Client("127.0.0.1", standin.port, tls=False, connect_timeout_s=2, keepalive_s=4,
                    stall_s=0.6)  # fmt: skip
    waits = 0
    real_wait = connection_module.Connection.wait

    async def counted(conn: connection_module.Connection, stall_s: float | None) -> None:
        nonlocal waits
        waits += 1
        await real_wait(conn, stall_s)

    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    monkeypatch.setattr(connection_module.Connection, "wait", counted)
    data = await response.read()
    assert data.count(b"data: ") == 8 + 3  # role, 8 tokens, finish, [DONE]
    assert waits <= 2  # not one per chunk (11 events)
    response.release()
    client.close()


async def test_an_upstream_silent_past_the_stall_timeout_fails_the_wait(
    standin: StandIn,
) -> None:
    standin.hold_s = 5.0  # the head at once, its first event only after 5 s
    client = Client("127.0.0.1", standin.port, tls=False, connect_timeout_s=2, keepalive_s=4,
                    stall_s=0.3)  # fmt: skip
    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    async with asyncio.timeout(4):
        with pytest.raises(Stalled, match=r"sent nothing for 0\.3 s"):
            await response.read()
    response.close()
    client.close()


async def test_one_stall_timer_serves_a_connections_waits_each_timed_from_its_start(
    standin: StandIn,
) -> None:
    client = Client("127.0.0.1", standin.port, tls=False, connect_timeout_s=2, keepalive_s=4,
                    stall_s=1.0)  # fmt: skip
    response = await client.request("GET", "/props", [], b"")
    await response.read()
    response.release()
    conn = response._conn
    timer = conn._stall_timer
    assert timer is not None  # armed by the first wait, and kept
    # The next exchange begins 0.8 s later and its first event takes 0.3 s: the timer, due 1 s
    # after the first wait, finds 0.2 s of silence in this wait and arms again, rather than
    # failing it for the 1 s since it was armed.
    await asyncio.sleep(0.8)
    standin.hold_s = 0.3
    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    assert response._conn is conn
    assert (await response.read()).endswith(b"data: [DONE]\n\n")
    response.release()
    client.close()
    assert conn._stall_timer is None  # disarmed at the close: nothing keeps the connection


async def test_a_head_request_has_no_body_to_wait_for(standin: StandIn) -> None:
    client = client_for(standin)
    response = await client.request("HEAD", "/props", [], b"")
    assert response.status in (200, 405)
    async with asyncio.timeout(10):
        assert await response.read() == b""
    response.release()
    client.close()


async def test_nobody_listening_is_a_connect_failure_and_a_reason_to_learn_afresh() -> None:
    standin = StandIn()
    await standin.start()
    port = standin.port
    await standin.stop()
    client = Client("127.0.0.1", port, tls=False, connect_timeout_s=2, keepalive_s=4, stall_s=5)
    client.keeps_streams = True  # learned from the server that has now gone
    with pytest.raises(ConnectFailed):
        await client.request("GET", "/props", [], b"")
    assert client.keeps_streams is None  # whatever answers next may be another build


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


async def stream(client: Client) -> client_module.PooledResponse:
    body = json.dumps({"messages": [], "stream": True}).encode()
    response = await client.request("POST", "/v1/chat/completions", [], body)
    assert (await response.read()).endswith(b"data: [DONE]\n\n")
    response.release()
    return response


async def verdict(client: Client) -> bool | None:
    """What the client learned of the upstream from its first stream, once it has."""
    async with asyncio.timeout(5):
        while client.keeps_streams is None:
            await asyncio.sleep(0.01)
    return client.keeps_streams


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


@pytest.fixture
def keeping(standin: StandIn, monkeypatch: pytest.MonkeyPatch) -> Client:
    """A client of a stand-in that keeps its connections after streams, probed quickly."""
    monkeypatch.setattr(reuse_module, "STREAM_PROBE_S", 0.05)
    standin.tokens, standin.token_delay_s, standin.close_after_stream = 2, 0, False
    return client_for(standin)


async def test_an_upstream_that_keeps_connections_after_streams_gets_them_reused(
    keeping: Client,
) -> None:
    client = keeping
    probed = await stream(client)
    assert probed._conn not in client._idle  # held aside while the client learns
    assert await verdict(client) is True
    kept = probed._conn
    for _ in range(5):
        assert client._idle[-1] is kept
        assert (await stream(client))._conn is kept  # the same connection, every time
    client.close()


async def test_an_upstream_that_starts_closing_after_streams_revokes_the_verdict(
    standin: StandIn, keeping: Client
) -> None:
    client = keeping
    await stream(client)
    assert await verdict(client) is True
    standin.close_after_stream = True  # as if restarted as a llama-server build
    await stream(client)
    await asyncio.sleep(0.05)  # its close arrives while the connection sits in the pool
    following = await client.request("GET", "/props", [], b"")
    await following.read()
    following.release()
    assert client.keeps_streams is False
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
        seen = (
            connection_module._peer_closed(open_conn),
            connection_module._peer_closed(closed_conn),
        )
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
    monkeypatch.setattr(reuse_module, "STREAM_PROBE_S", 0.05)

    async def scenario() -> tuple[bool | None, int]:
        standin = StandIn(tokens=2, token_delay_s=0)  # closes after a stream
        await standin.start()
        client = client_for(standin)
        try:
            await stream(client)  # released before the upstream's close is read...
            time.sleep(0.2)  # noqa: ASYNC251 - ...then the loop stalls past the probe's end
            await asyncio.sleep(0.1)
            verdict = client.keeps_streams
            for _ in range(5):  # a connection pooled by a wrong verdict would fail these
                await stream(client)
            return verdict, standin.finished
        finally:
            client.close()
            await standin.stop()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(scenario()) == (False, 6)


# -- against a hostile upstream ----------------------------------------------------------------


def client_of(hostile: Hostile) -> Client:
    return Client(hostile.host, hostile.port, tls=False, connect_timeout_s=2, keepalive_s=4,
                  stall_s=5)  # fmt: skip


async def exchange(client: Client) -> tuple[int, bytes, client_module.PooledResponse]:
    response = await client.request("POST", "/tokenize", [], b"{}")
    body = await response.read()
    response.release()
    return response.status, body, response


def connections(hostile: Hostile) -> list[int]:
    """The connection each answered request came on, in order."""
    return [request.connection for request in hostile.served()]


async def test_two_responses_in_one_read_give_the_first_and_close_the_connection(
    hostile: Hostile,
) -> None:
    hostile.script.append(
        sends(reply(200, b'{"n":1}') + reply(200, b'{"n":"extra"}', (("X-Extra", "1"),)))
    )
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    client = client_of(hostile)
    status, body, first = await exchange(client)
    assert (status, body) == (200, b'{"n":1}')
    assert first.header(b"x-extra") is None
    assert (await exchange(client))[1] == b'{"n":2}'
    assert connections(hostile) == [1, 2]  # the one that sent too much was not reused
    client.close()


async def test_a_response_arriving_on_an_idle_connection_closes_it(hostile: Hostile) -> None:
    hostile.script.append(sends(reply(200, b'{"n":1}'), 0.05, reply(200, b'{"n":"extra"}')))
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    client = client_of(hostile)
    await exchange(client)
    await asyncio.sleep(0.2)  # the response too many arrives while the connection is pooled
    assert (await exchange(client))[1] == b'{"n":2}'
    assert connections(hostile) == [1, 2]
    client.close()


async def test_a_response_too_many_never_becomes_part_of_the_next_answer(
    hostile: Hostile,
) -> None:
    # Its head arrives while the connection idles; its body comes with the next real answer.
    hostile.script.append(
        sends(reply(200, b'{"n":1}'), 0.05, b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n")
    )

    async def second(peer: Peer, _: Request) -> None:
        if peer.number == 1:
            await peer.write(b'"extra"')
        await peer.write(reply(200, b'{"n":2}'))

    hostile.script.append(second)
    client = client_of(hostile)
    await exchange(client)
    await asyncio.sleep(0.2)
    assert (await exchange(client))[:2] == (200, b'{"n":2}')
    client.close()


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_bytes_the_loop_has_not_read_yet_keep_an_idle_connection_from_reuse(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    async def scenario() -> tuple[bytes, list[int]]:
        hostile = Hostile(fallback=sends(reply(200, b'{"n":2}')))
        hostile.script.append(sends(reply(200, b'{"n":1}')))
        await hostile.start()
        client = client_of(hostile)
        try:
            await exchange(client)
            hostile.peers[1].write_now(reply(200, b'{"n":"extra"}'))
            time.sleep(0.05)  # noqa: ASYNC251 - in the kernel now, and the loop has not looked
            _, body, _ = await exchange(client)
            return body, connections(hostile)
        finally:
            client.close()
            await hostile.stop()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(scenario()) == (b'{"n":2}', [1, 2])


async def test_a_response_head_over_the_bound_fails_and_costs_no_more_than_the_bound(
    hostile: Hostile,
) -> None:
    hostile.script.append(huge_head(20 * MiB))
    client = client_of(hostile)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="head"):
            await client.request("POST", "/tokenize", [], b"{}")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB  # the bound is 64 KiB: nothing near the 20 MB head was held
    assert hostile.sent < 20 * MiB  # and slotgate hung up rather than read it all
    client.close()


async def test_a_head_within_the_bound_is_read_whatever_its_pieces(hostile: Hostile) -> None:
    padding = "a" * (connection_module.MAX_HEAD_BYTES - 200)
    answer = reply(200, b'{"n":1}', (("X-Padding", padding),))
    hostile.script.append(sends(*(answer[i : i + 1000] for i in range(0, len(answer), 1000))))
    client = client_of(hostile)
    status, body, response = await exchange(client)
    assert (status, body) == (200, b'{"n":1}')
    assert response.header(b"x-padding") == padding.encode()
    client.close()


async def test_a_body_that_arrives_with_its_head_past_the_bound_is_read_intact(
    hostile: Hostile,
) -> None:
    body = bytes(range(256)) * 2000  # 512,000 bytes, one write: the first read crosses the bound
    hostile.script.append(sends(reply(200, body, (("Content-Type", "application/octet-stream"),))))
    client = client_of(hostile)
    assert (await exchange(client))[:2] == (200, body)
    client.close()


async def test_interim_answers_are_skipped_for_the_final_one(hostile: Hostile) -> None:
    hostile.script.append(
        sends(
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n",
            reply(200, b'{"n":1}', (("X-Final", "1"),)),
        )
    )
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    client = client_of(hostile)
    status, body, response = await exchange(client)
    assert (status, body) == (200, b'{"n":1}')
    assert response.header(b"x-final") == b"1"
    assert response.header(b"link") is None  # the interim answer's headers are not the answer's
    assert (await exchange(client))[1] == b'{"n":2}'
    assert connections(hostile) == [1, 1]  # a 1xx is part of the exchange, not a surplus
    client.close()


async def test_a_chunked_answers_trailers_are_not_taken_for_its_headers(hostile: Hostile) -> None:
    hostile.script.append(
        sends(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
            b'7\r\n{"n":1}\r\n0\r\nContent-Type: text/html\r\nX-Late: 1\r\n\r\n'
        )
    )
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    client = client_of(hostile)
    status, body, response = await exchange(client)
    assert (status, body) == (200, b'{"n":1}')
    # What came after the body is no header of the answer: relayed as one, it would give the
    # client a second Content-Type.
    assert [name for name, _ in response.headers].count(b"content-type") == 1
    assert response.header(b"content-type") == b"application/json"
    assert response.header(b"x-late") is None
    assert (await exchange(client))[1] == b'{"n":2}'
    assert connections(hostile) == [1, 1]
    client.close()


async def test_a_switching_protocols_answer_is_a_protocol_error(hostile: Hostile) -> None:
    hostile.script.append(
        sends(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\nframes")
    )
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    client = client_of(hostile)
    with pytest.raises(ProtocolError, match="101"):
        await client.request("POST", "/tokenize", [], b"{}")
    assert (await exchange(client))[1] == b'{"n":2}'
    assert connections(hostile) == [1, 2]
    client.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
async def test_a_body_read_whole_stops_at_its_limit(hostile: Hostile, chunked: bool) -> None:
    hostile.script.append(huge_error(200 * MiB, chunked=chunked))
    client = client_of(hostile)
    response = await client.request("POST", "/tokenize", [], b"{}")
    assert response.status == 500
    with pytest.raises(BodyTooLarge, match="65536"):
        await response.read(limit_bytes=65536)
    response.release()  # an unfinished body: its connection is closed
    assert not client._idle
    assert hostile.sent < 200 * MiB
    client.close()


async def test_an_ipv6_upstream_gets_its_host_in_brackets() -> None:
    hostile = Hostile(host="::1")
    try:
        await hostile.start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    client = client_of(hostile)
    try:
        assert (await exchange(client))[0] == 200
    finally:
        client.close()
        await hostile.stop()
    assert hostile.requests[0].headers[b"host"] == f"[::1]:{hostile.port}".encode()


# -- handed on at its end (`when_done`) ----------------------------------------------------------


async def test_a_response_told_of_its_end_is_told_before_its_reader_wakes_and_keeps_its_bytes(
    hostile: Hostile,
) -> None:
    body = b'{"tokens": [' + b"1, " * 2000 + b"2]}"
    whole = reply(200, body)
    hostile.script.append(sends(whole[:-3000], 0.05, whole[-3000:-1000], whole[-1000:]))
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    client = client_of(hostile)
    response = await client.request("POST", "/tokenize", [], b"{}")
    told: list[int] = []
    read = bytearray()

    def ended() -> None:
        # The reader has not had the last bytes yet, and the response can be given back.
        assert len(read) < len(body)
        told.append(len(client._idle))
        response.release()
        told.append(len(client._idle))

    response.when_done(ended)
    while chunk := await response.readany():
        read += chunk
    assert told == [0, 1]  # told once, and its connection went back to the pool
    assert read == body
    # The connection it gave back carries the next exchange.
    assert (await exchange(client))[1] == b'{"n":2}'
    assert connections(hostile) == [1, 1]
    client.close()


async def test_a_body_read_whole_after_its_end_was_told_is_whole(hostile: Hostile) -> None:
    body = bytes(range(256)) * 400
    whole = reply(200, body, (("Content-Type", "application/octet-stream"),))
    hostile.script.append(sends(whole[:-5000], 0.05, whole[-5000:]))
    client = client_of(hostile)
    response = await client.request("POST", "/tokenize", [], b"{}")
    response.when_done(response.release)
    assert await response.read() == body
    client.close()


async def test_bytes_past_an_end_that_was_told_still_keep_its_connection_from_reuse(
    hostile: Hostile,
) -> None:
    # The body's end and an extra answer come in one read, after the head.
    first = reply(200, b'{"n":1}')
    extra = reply(200, b'{"n":"extra"}', (("X-Extra", "1"),))
    hostile.script.append(sends(first[:-3], 0.05, first[-3:] + extra))
    hostile.fallback = sends(reply(200, b'{"n":2}'))
    client = client_of(hostile)
    response = await client.request("POST", "/tokenize", [], b"{}")
    told: list[bool] = []
    response.when_done(lambda: told.append(True))
    assert await response.read() == b'{"n":1}'
    response.release()
    # The extra answer came in the same read as the end: the connection was closed for it,
    # and the one told of its end was not told (nothing of it may be reused).
    assert told == []
    assert (await exchange(client))[1] == b'{"n":2}'
    assert connections(hostile) == [1, 2]
    client.close()


async def test_the_next_exchange_on_a_connection_given_back_at_its_end_gets_its_answer(
    hostile: Hostile,
) -> None:
    whole = reply(200, b'{"n":1}')
    hostile.script.append(sends(whole[:-3], 0.05, whole[-3:]))
    hostile.script.append(sends(0.05, reply(200, b'{"n":2}')))
    client = client_of(hostile)
    first = await client.request("POST", "/tokenize", [], b"{}")
    nexts: list[asyncio.Task[tuple[int, bytes, client_module.PooledResponse]]] = []

    def ended() -> None:
        first.release()
        # The next exchange takes the connection and waits on it before the first reader
        # resumes, as a waiter handed the slot does.
        nexts.append(asyncio.ensure_future(exchange(client)))

    first.when_done(ended)
    assert await first.read() == b'{"n":1}'
    assert await first.readany() == b""
    status, body, _ = await asyncio.wait_for(nexts[0], 5)
    assert (status, body) == (200, b'{"n":2}')
    assert connections(hostile) == [1, 1]
    client.close()


async def test_a_callback_at_the_end_that_raises_still_wakes_the_reader(
    hostile: Hostile, caplog: pytest.LogCaptureFixture
) -> None:
    whole = reply(200, b'{"n":1}')
    hostile.script.append(sends(whole[:-3], 0.05, whole[-3:]))
    client = client_of(hostile)
    response = await client.request("POST", "/tokenize", [], b"{}")

    def broken() -> None:
        raise RuntimeError("a bug in the callback")

    response.when_done(broken)
    # The loop reports the error and closes the connection; the reader has its body at once.
    assert await asyncio.wait_for(response.read(), 5) == b'{"n":1}'
    response.release()
    client.close()
