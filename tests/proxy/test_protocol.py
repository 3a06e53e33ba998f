"""The HTTP protocol slotgate runs uvicorn with: a bound on request heads, on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import uvicorn
from slotgate.intake.body import take_off_loop
from slotgate.proxy import relay as relay_module
from slotgate.proxy import watch as watch_module
from slotgate.proxy.cycle import Cycle
from slotgate.proxy.protocol import HEAD_LIMIT_BYTES, HOLD_LIMIT_BYTES, Connection, http_protocol

from tests.conftest import CHAT, GateFactory, RunningGate, chat
from tests.support.standin import StandIn


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


# -- clients that leave with requests still in line on one connection --------------------------


def generation(stream: bool, request_id: str = "queued", padding: int = 0) -> bytes:
    body = json.dumps(chat(stream=stream, padding="x" * padding)).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: %s\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (CHAT.encode(), request_id.encode(), len(body), body)
    )


async def only_slot_held(
    start_gate: GateFactory, standin: StandIn, **settings: Any
) -> tuple[RunningGate, asyncio.StreamWriter]:
    """slotgate before a one-slot stand-in, that slot held by `hold_the_only_slot`."""
    standin.total_slots = 1
    gate: RunningGate = await start_gate(**settings)
    return gate, await hold_the_only_slot(gate, standin)


async def hold_the_only_slot(gate: RunningGate, standin: StandIn) -> asyncio.StreamWriter:
    """A streaming generation that keeps the stand-in's one slot busy until it is closed."""
    standin.tokens, standin.token_delay_s = 100_000, 0.05
    _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(generation(stream=True, request_id="holder"))
    await gate.until(lambda: standin.running == 1)
    standin.tokens = 5  # for what comes after it
    return writer


def queued_behind(connection: object) -> bool:
    """A request read on this connection waits for the one before it to be answered."""
    return isinstance(connection, Connection) and bool(connection.pipeline)


def paused(connection: object) -> bool:
    """Not even held: the connection's socket is no longer read."""
    return isinstance(connection, Connection) and connection.socket_paused


def request_ids(standin: StandIn) -> list[str | None]:
    return [{k.lower(): v for k, v in s.headers.items()}.get("x-request-id") for s in standin.seen]


def hang_up(writer: asyncio.StreamWriter, how: str) -> None:
    if how == "reset":
        # SO_LINGER 0: the close sends RST, not FIN, and drops what is unsent.
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


@pytest.mark.parametrize("how", ["fin", "reset"])
@pytest.mark.parametrize(
    "then", [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"second", b"second, large"]
)
@pytest.mark.parametrize("apart", [False, True])
async def test_a_pipelined_client_that_hangs_up_takes_its_queued_generation_out_of_line(
    start_gate: GateFactory, standin: StandIn, how: str, then: bytes, apart: bool
) -> None:
    gate, holder = await only_slot_held(start_gate, standin)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
        second = then
        if then.startswith(b"second"):
            # A large one is more than the connection holds unread: its socket is paused.
            padding = 4 * HOLD_LIMIT_BYTES if then.endswith(b"large") else 0
            second = generation(stream=True, request_id="second", padding=padding)
        writer.write(generation(stream=False))
        if apart:  # the second request comes once the first is settled in line
            await gate.until(lambda: gate.service.admission.queued == 1)
            await asyncio.sleep(0.2)  # well after it began to watch for its client leaving
        writer.write(second)
        await writer.drain()
        await gate.until(lambda: gate.service.admission.queued == 1)
        await gate.until(
            lambda: any(queued_behind(c) for c in gate.server.server_state.connections)
        )
        if apart and then.endswith(b"large"):  # the sweep finds it gone, by asking the kernel
            await gate.until(lambda: any(paused(c) for c in gate.server.server_state.connections))
        hang_up(writer, how)
        # It leaves the line at once, while the slot is still busy; nothing of it goes upstream.
        await gate.until(lambda: gate.service.admission.queued == 0)
        assert standin.running == 1
        assert request_ids(standin) == ["holder"]
    finally:
        holder.close()
    await gate.until(lambda: gate.service.admission.active == 0)
    assert request_ids(standin) == ["holder"]


@pytest.mark.parametrize("how", ["fin", "reset"])
async def test_a_request_waiting_in_line_learns_of_its_client_leaving_from_the_connection_alone(
    start_gate: GateFactory, standin: StandIn, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # No pending receive() as a task of its own: a waiting request is the one task uvicorn
    # runs it in, and its connection's end still takes it out of line at once.
    monkeypatch.setattr(watch_module, "WATCH_AFTER_S", 0.0)
    gate, holder = await only_slot_held(start_gate, standin)
    try:
        before = asyncio.all_tasks()
        writers = []
        for _ in range(3):
            _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
            writer.write(generation(stream=False))
            writers.append(writer)
        await gate.until(lambda: gate.service.admission.queued == 3)
        await asyncio.sleep(0.1)  # every one of them watches for its client by now
        assert len(asyncio.all_tasks() - before) == 3
        hang_up(writers[0], how)
        await gate.until(lambda: gate.service.admission.queued == 2)
        for writer in writers[1:]:
            hang_up(writer, how)
        await gate.until(lambda: gate.service.admission.queued == 0)
        assert request_ids(standin) == ["holder"]
    finally:
        holder.close()
    await gate.until(lambda: gate.service.admission.active == 0)


@pytest.mark.interpreted
async def test_a_client_gone_before_its_request_began_to_watch_still_takes_it_out_of_line(
    start_gate: GateFactory, standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The connection ended while nothing watched it (its body was still being read for its
    # demand): the watch, once it starts, finds it so, through a pending receive().
    gate, holder = await only_slot_held(start_gate, standin)
    read = asyncio.Event()

    async def slow_intake(*args: Any, **kwargs: Any) -> Any:
        await read.wait()
        return await take_off_loop(*args, **kwargs)

    monkeypatch.setattr(relay_module, "take_off_loop", slow_intake)
    connections = gate.server.server_state.connections
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
        writer.write(generation(stream=False))
        await gate.until(lambda: len(connections) == 2)
        hang_up(writer, "fin")
        await gate.until(lambda: len(connections) == 1)  # its connection is gone
        entered = gate.service.admission._next_seq
        read.set()
        await gate.until(lambda: gate.service.admission._next_seq > entered)  # in line
        await gate.until(lambda: gate.service.admission.queued == 0)
        assert request_ids(standin) == ["holder"]
    finally:
        holder.close()
    await gate.until(lambda: gate.service.admission.active == 0)


# -- heads that take too long, and upgrades ----------------------------------------------------


async def read_answer(
    reader: asyncio.StreamReader, first: bytes = b""
) -> tuple[bytes, dict[str, object]]:
    """The status line and the JSON error of an answer slotgate ends by closing (`first`: its
    bytes read already)."""
    answer = first + await asyncio.wait_for(reader.read(), 10)
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)["error"]


async def test_a_head_trickled_byte_by_byte_is_answered_408_after_the_head_timeout(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(head_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Slow: ")

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            while not writer.is_closing():
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.02)

    trickling = asyncio.create_task(trickle())
    try:
        # The trickle stops at the answer's first byte: a byte sent after slotgate has closed
        # the socket makes the kernel answer RST, which on a slow client can discard the 408
        # still unread in its buffer (a busy machine's test client is such a client).
        first = await asyncio.wait_for(reader.read(1), 10)
        trickling.cancel()
        status, error = await read_answer(reader, first)  # and then the connection is closed
    finally:
        trickling.cancel()
        writer.close()
    assert status == b"HTTP/1.1 408 Request Timeout"
    assert error["code"] == "request_timeout"
    assert "HEAD_TIMEOUT_S" in str(error["message"])
    assert standin.seen == []
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200


async def test_every_connection_that_never_finishes_its_head_is_swept(
    start_gate: GateFactory, standin: StandIn
) -> None:
    # Each connection's clock runs from its accept: its bytes are written as soon as it is open,
    # not after all 200 (that took longer than the timeout on a loaded machine, and a
    # connection whose bytes came too late was rightly closed as one that sent nothing).
    gate = await start_gate(head_timeout_s=1.0)
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for i in range(200):
            reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
            streams.append((reader, writer))
            if i % 4:  # and every fourth sends nothing at all
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n"[: 1 + i % 30])
        answers = await asyncio.wait_for(asyncio.gather(*(r.read() for r, _ in streams)), 60)
    finally:
        for _, writer in streams:
            writer.close()
    for i, answer in enumerate(answers):
        # The ones that asked nothing are closed without an answer.
        assert answer.startswith(b"HTTP/1.1 408 ") if i % 4 else answer == b"", i
    assert standin.seen == []
    await gate.until(lambda: not gate.server.server_state.connections)


async def test_a_request_waiting_in_line_is_not_cut_by_the_head_timeout(
    start_gate: GateFactory, standin: StandIn
) -> None:
    gate, holder = await only_slot_held(start_gate, standin, head_timeout_s=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    # The next request's head begins behind it, and waits as long as the first one does.
    writer.write(generation(stream=False) + b"GET /health HT")
    await gate.until(lambda: gate.service.admission.queued == 1)
    await asyncio.sleep(0.6)  # three head timeouts
    holder.close()
    writer.write(b"TP/1.1\r\nHost: x\r\n\r\n")
    first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert first.startswith(b"HTTP/1.1 200 ")
    writer.close()


UPGRADES = [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
    b"Upgrade: websocket\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    b"CONNECT 127.0.0.1:8080 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n",
]
NOT_HTTP = [
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    b"\x16\x03\x01",
]


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        *(
            pytest.param(head, "upgrade_not_supported", id=name)
            for head, name in zip(
                UPGRADES, ["websocket-post", "websocket", "h2c", "connect"], strict=True
            )
        ),
        *(
            pytest.param(data, "invalid_request", id=name)
            for data, name in zip(
                NOT_HTTP, ["h2-prior-knowledge", "bad-header", "tls-hello"], strict=True
            )
        ),
    ],
)
async def test_an_upgrade_or_a_request_that_is_not_http_is_refused_400_at_once_in_the_api_shape(
    start_gate: GateFactory, standin: StandIn, request_bytes: bytes, code: str
) -> None:
    gate = await start_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(request_bytes)
    try:
        status, error = await read_answer(reader)
    finally:
        writer.close()
    assert status == b"HTTP/1.1 400 Bad Request"
    assert error["code"] == code
    assert standin.seen == []


async def test_a_slow_body_sender_takes_no_slot_while_it_trickles(
    start_gate: GateFactory, standin: StandIn
) -> None:
    gate = await start_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    body = b'{"messages":[],"stream":false}'
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n")  # fmt: skip
    for byte in body[:-1]:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.005)
        assert gate.service.admission.active == 0
    writer.write(body[-1:])
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    writer.close()


async def refused_431(
    client: httpx.AsyncClient, gate: RunningGate, headers: dict[str, str]
) -> dict[str, Any]:
    """The error slotgate answers a chat sent with `headers` with, a 431."""
    response = await client.post(gate.url + CHAT, json=chat(), headers=headers)
    assert response.status_code == 431
    error: dict[str, Any] = response.json()["error"]
    return error


async def test_oversized_headers_get_431_and_never_reach_upstream(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    error = await refused_431(client, gate, {"X-Big": "a" * 100_000})
    assert error["code"] == "headers_too_large"
    # Many lines, each within llama-server's 8 KiB per line, that add up past the total.
    await refused_431(client, gate, {f"X-Part-{i}": "a" * 8000 for i in range(9)})
    assert standin.seen == []


async def test_a_header_line_longer_than_llama_server_takes_gets_431_and_no_slot(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    error = await refused_431(client, gate, {"X-Big": "a" * 8200})
    assert "x-big" in error["message"]
    assert standin.seen == []
    fits = await client.post(gate.url + CHAT, json=chat(), headers={"X-Big": "a" * 8000})
    assert fits.status_code == 200


async def served_status(
    gate: RunningGate, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> bytes:
    """The status line of a non-streamed generation sent on a connection, once its whole
    answer has arrived."""
    writer.write(generation(stream=False))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    return head.split(b"\r\n")[0]


async def test_a_request_whose_url_fails_inside_the_header_callback_is_answered_400_alone(
    start_gate: GateFactory, standin: StandIn
) -> None:
    # A port past 65535 gets by the parser and fails httptools.parse_url inside the protocol's
    # on_headers_complete.
    standin.tokens = 1
    gate = await start_gate()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        writer.write(b"GET http://a:99999999/ HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == (
        "invalid_request_error"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        assert await served_status(gate, reader, writer) == b"HTTP/1.1 200 OK"
        assert await served_status(gate, reader, writer) == b"HTTP/1.1 200 OK"
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def plain_server(app: Any, **config: Any) -> AsyncIterator[uvicorn.Server]:
    """uvicorn serving `app` through slotgate's protocol on a free port."""
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, http=http_protocol(0), loop="asyncio",
            lifespan="off", log_config=None, access_log=False, **config,
        )
    )  # fmt: skip
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.005)
        yield server
    finally:
        server.should_exit = True
        await task


def port_of(server: uvicorn.Server) -> int:
    (listener,) = server.servers[0].sockets
    return int(listener.getsockname()[1])


async def test_an_idle_connection_is_closed_after_the_keep_alive_and_a_busy_one_is_not() -> None:
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    async with plain_server(app, timeout_keep_alive=1) as server:
        port = port_of(server)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        try:
            idle_writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(idle_reader.readuntil(b"ok"), 10)
            answered = loop.time()
            busy_writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            # The idle one is closed (EOF), not before its keep-alive.
            assert await asyncio.wait_for(idle_reader.read(), 30) == b""
            assert loop.time() - answered >= 1.0
            # The busy one, twice as long without a byte, is still served.
            await asyncio.sleep(1.0)
            release.set()
            assert (await asyncio.wait_for(busy_reader.readuntil(b"ok"), 10)).startswith(
                b"HTTP/1.1 200 OK\r\n"
            )
        finally:
            idle_writer.close()
            busy_writer.close()


async def test_a_pipelined_answer_and_a_body_of_several_pieces_reach_the_app_whole() -> None:
    bodies: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message["body"]
            if not message["more_body"]:
                break
        bodies.append(body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async with plain_server(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
        try:
            big = b"b" * (3 * HOLD_LIMIT_BYTES)
            writer.write(
                b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirst"
                b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nsec\r\n3\r\nond\r\n0\r\n\r\n"
                b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(big)
            )
            for start in range(0, len(big), 4096):
                writer.write(big[start : start + 4096])
                await writer.drain()
            answers = b""
            while answers.count(b"HTTP/1.1 200 OK") < 3 or not answers.endswith(big):
                got = await asyncio.wait_for(reader.read(65536), 10)
                assert got, answers[-200:]
                answers += got
        finally:
            writer.close()
    assert bodies == [b"first", b"second", big]


async def until(check: Callable[[], bool]) -> None:
    """Wait until `check()` holds; bounded generously, as a loaded machine can be slow."""
    async with asyncio.timeout(30.0):
        while not check():
            await asyncio.sleep(0.01)


async def test_every_receive_waiting_at_once_learns_that_the_client_left() -> None:
    # ASGI lets an app wait in receive() from more than one task (a listener for the client
    # leaving beside the app's own); uvicorn wakes every one of them.
    told: list[str] = []
    listeners: list[asyncio.Task[None]] = []
    waiting = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the whole body

        async def listen() -> None:
            told.append((await receive())["type"])

        listeners.extend(asyncio.create_task(listen()) for _ in range(3))
        await asyncio.sleep(0)  # each has run to its wait
        waiting.set()
        await asyncio.gather(*listeners)

    async with plain_server(app) as server:
        _, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
        try:
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            await asyncio.wait_for(waiting.wait(), 10)
            writer.close()
            await until(lambda: len(told) == 3)
        finally:
            for listener in listeners:  # one never told would keep the server from stopping
                listener.cancel()
    assert told == ["http.disconnect"] * 3


def alive(kinds: tuple[type, ...]) -> int:
    """How many objects of these kinds the garbage collector knows of."""
    return sum(isinstance(o, kinds) for o in gc.get_objects())


async def test_a_closed_connection_and_its_requests_are_freed_without_the_collector() -> None:
    # As uvicorn's are: a connection left to the collector keeps its parser, its requests and
    # their unread bodies until a collection of the oldest generation comes round.
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    async with plain_server(app) as server:
        state = server.server_state
        gc.collect()
        gc.disable()
        try:
            before = alive((Connection, Cycle))
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
            await asyncio.wait_for(reader.readuntil(b"ok"), 10)
            writer.close()
            # And one that leaves with a request still in line behind another.
            _, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
            writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await until(lambda: any(queued_behind(c) for c in state.connections))
            writer.close()
            await until(lambda: not state.connections)
            release.set()
            await until(lambda: not state.tasks)
            for _ in range(3):
                await asyncio.sleep(0)
            assert alive((Connection, Cycle)) == before
        finally:
            gc.enable()


def unread_body(connection: object) -> int:
    """The bytes of body its newest request has not read yet."""
    return (
        connection.cycle.body_size if isinstance(connection, Connection) and connection.cycle else 0
    )


async def test_a_body_sent_in_tiny_chunks_is_held_at_about_its_own_size() -> None:
    # An object per chunk would make a body of two bytes a chunk cost some thirty times its
    # size while the app has not read it; uvicorn holds the body itself.
    release = asyncio.Event()
    bodies: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        bodies.append(body)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    chunks = HOLD_LIMIT_BYTES // 2 - 1  # all of it taken in: just under what pauses reading
    payload = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + (
        b"2\r\nab\r\n" * chunks
    )
    loop = asyncio.get_running_loop()
    async with plain_server(app) as server:
        state = server.server_state
        # A plain socket: what the client has not sent yet stays in `payload`, not copied.
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port_of(server)))
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                await asyncio.wait_for(loop.sock_sendall(sock, payload), 30)
                await until(lambda: any(unread_body(c) == 2 * chunks for c in state.connections))
                held, _ = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
                release.set()
            await loop.sock_sendall(sock, b"0\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer:
                got = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
                assert got, answer
                answer += got
        finally:
            sock.close()
    assert held - before < 8 * HOLD_LIMIT_BYTES  # the body, and a read's worth more
    assert answer.startswith(b"HTTP/1.1 204 ")
    assert bodies == [b"ab" * chunks]


def statuses(answers: bytes) -> list[bytes]:
    """The status codes of the answers on a connection, in order."""
    return re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """What a connection answers until slotgate closes it."""
    return await asyncio.wait_for(reader.read(), 10)


async def test_a_refusal_behind_a_request_not_answered_yet_comes_after_its_answer() -> None:
    # Written at once, the 400 would be read as the answer to the request before it.
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    async with plain_server(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
        try:
            writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP\r\n\r\n")
            answers = await read_to_end(reader)
        finally:
            writer.close()
    assert statuses(answers) == [b"200", b"400"]


async def test_a_refusal_never_lands_inside_an_answer_being_streamed() -> None:
    release = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/stream":
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await release.wait()
        await send({"type": "http.response.body", "body": b"last"})

    async with plain_server(app) as server:
        state = server.server_state
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(server))
        try:
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            answers = await asyncio.wait_for(reader.readuntil(b"first\r\n"), 10)
            # A request queued behind the stream, then bytes that are not HTTP, read at once.
            writer.write(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP\r\n\r\n")
            await until(lambda: any(queued_behind(c) for c in state.connections))
            release.set()
            answers += await read_to_end(reader)
        finally:
            writer.close()
    assert statuses(answers) == [b"200", b"200", b"400"]
    stream, _, rest = answers.partition(b"0\r\n\r\n")
    assert stream.endswith(b"5\r\nfirst\r\n4\r\nlast\r\n")
    assert rest.startswith(b"HTTP/1.1 200 ")
