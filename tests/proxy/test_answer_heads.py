"""Answers' heads and ends as clients see them on real sockets: whatever framing llama-server
answers with (204, 304, chunked, capitals, duplicates, many headers), HEAD requests, pipelined
requests, slotgate's own routes with and without keys, and the ways a relayed non-streamed
answer ends early (its client leaving, an operator's cancel, the drain timeout at shutdown)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from slotgate.proxy import relay as relay_module
from slotgate.proxy.modes import WHOLE_BODY_BYTES
from slotgate.proxy.protocol import Connection

from tests.conftest import CHAT, GateFactory, RunningGate, before_hostile, chat
from tests.proxy.test_protocol import hang_up
from tests.support.hostile import CHAT_STREAM, Answer, Hostile, Peer, Request, reply, sends
from tests.support.standin import StandIn

Head = tuple[int, list[tuple[bytes, bytes]]]


async def read_answer(reader: asyncio.StreamReader, method: str) -> tuple[Head, bytes]:
    """One answer off a keep-alive connection, read by its own framing as a client would."""
    async with asyncio.timeout(30):
        raw = await reader.readuntil(b"\r\n\r\n")
        line, *fields = raw[:-4].split(b"\r\n")
        status = int(line.split(b" ", 2)[1])
        headers = [(n, v.strip()) for n, _, v in (f.partition(b":") for f in fields)]
        names = [n for n, _ in headers]
        if method == "HEAD" or status in (204, 304):
            return (status, headers), b""
        if b"transfer-encoding" in names:
            body = b""
            while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
                body += (await reader.readexactly(size + 2))[:-2]
            await reader.readexactly(2)
            return (status, headers), body
        length = int(dict(headers)[b"content-length"])
        return (status, headers), await reader.readexactly(length)


def ask(method: str, path: str, extra: bytes = b"") -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (method.encode(), path.encode(), extra)


#: llama-server's answers to a GET, each one a framing or a head a relay could get wrong.
FRAMINGS = {
    "no-content": b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n",
    "not-modified": b'HTTP/1.1 304 Not Modified\r\nETag: "e"\r\n\r\n',
    "chunked": (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b'5\r\n{"a":\r\n2\r\n1}\r\n0\r\n\r\n'
    ),
    "odd-names": reply(
        200,
        b'{"a":1}',
        (
            ("X-UPPER-Case", "V"),
            ("Set-Cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("X-Empty", ""),
            ("X-Tab", "a\tb"),
            ("Server", "llama"),
            ("Date", "yesterday"),
            ("Keep-Alive", "5"),
        ),
    ),
    "many-headers": reply(200, b'{"a":1}', tuple((f"X-H{i}", str(i)) for i in range(90))),
}


@pytest.mark.parametrize("framing", sorted(FRAMINGS))
async def test_any_framing_llama_server_answers_with_is_relayed_framed_and_both_connections_reused(
    start_gate: GateFactory, hostile: Hostile, framing: str
) -> None:
    gate = await before_hostile(start_gate, hostile)
    hostile.fallback = sends(FRAMINGS[framing])
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    methods = ["GET", "GET", "HEAD", "GET"]
    try:
        # Pipelined, all four at once: each answer must end where its framing says.
        writer.write(b"".join(ask(method, "/slots") for method in methods))
        answers = [await read_answer(reader, method) for method in methods]
        # And the connection still serves: nothing was left over or cut.
        writer.write(ask("GET", "/health"))
        hostile.fallback = sends(reply(200, b'{"status":"ok"}'))
        (status, _), body = await read_answer(reader, "GET")
        assert (status, body) == (200, b'{"status":"ok"}')
    finally:
        writer.close()
    heads = [head for head, _ in answers]
    assert len({status for status, _ in heads}) == 1
    first_status, first = heads[0]
    for (_, headers), method in zip(heads, methods, strict=True):
        names = [name for name, _ in headers]
        assert all(name == name.lower() for name in names)
        # One date (slotgate's), no server of llama-server's, no hop-by-hop header relayed.
        assert names.count(b"date") == 1
        assert dict(headers)[b"date"] != b"yesterday"
        assert b"server" not in names
        assert b"keep-alive" not in names
        framing_of = [name for name in names if name in (b"transfer-encoding", b"content-length")]
        if first_status in (204, 304):
            assert framing_of == []  # no body, and none announced
        elif framing == "chunked":
            # A HEAD's answer is the GET's head but for the framing of a body it does not have.
            assert framing_of == ([] if method == "HEAD" else [b"transfer-encoding"])
        else:
            assert framing_of == [b"content-length"]
            assert dict(headers)[b"content-length"] == b"7"
    gets = [body for (_, _), body in answers[:2]]
    assert gets[0] == gets[1]
    if first_status == 200:
        assert json.loads(gets[0]) == {"a": 1}
    if framing == "odd-names":
        assert [v for n, v in first if n == b"set-cookie"] == [b"a=1", b"b=2"]
        assert (b"x-upper-case", b"V") in first
        assert (b"x-tab", b"a\tb") in first
        assert (b"x-empty", b"") in first
    if framing == "many-headers":
        assert [n for n, _ in first if n.startswith(b"x-h")] == [b"x-h%d" % i for i in range(90)]
    # The two GETs before the HEAD went over one connection to llama-server, pooled between.
    served = [r for r in hostile.served() if r.target == "/slots"]
    assert [r.method for r in served] == methods
    assert served[0].connection == served[1].connection


def until_closed(closed: asyncio.Event, head: bytes = b"") -> Answer:
    """Write `head` (nothing, or the start of an answer), then wait for slotgate to close the
    connection, and say so: the way llama-server learns to stop generating."""

    async def answer(peer: Peer, _: Request) -> None:
        if head:
            await peer.write(head)
        while not peer.hung_up():
            await asyncio.sleep(0.01)
        closed.set()

    return answer


def generation_bytes(request_id: str) -> bytes:
    body = json.dumps(chat()).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: %s\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (CHAT.encode(), request_id.encode(), len(body), body)
    )


async def metrics_text(gate: RunningGate) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        writer.write(ask("GET", "/metrics?source=slotgate"))
        _, body = await read_answer(reader, "GET")
    finally:
        writer.close()
    return body.decode()


async def error_of(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    (status, _), body = await read_answer(reader, "POST")
    error: dict[str, Any] = json.loads(body)["error"]
    return status, error


@pytest.mark.parametrize("when", ["before-its-head", "after-its-head", "mid-body"])
@pytest.mark.parametrize("how", ["client-leaves", "operator-cancels", "shutdown-drain-ends"])
async def test_a_relayed_non_streamed_answer_cut_short_closes_llama_servers_connection_and_says_why(
    start_gate: GateFactory,
    hostile: Hostile,
    caplog: pytest.LogCaptureFixture,
    how: str,
    when: str,
) -> None:
    # Sent as it is (not assembled from a stream): llama-server's answer is relayed whole, and
    # until it is, the slot is held by a connection that must be closed for llama-server to
    # stop generating.
    gate = await before_hostile(start_gate, hostile, stream_upstream=False)
    closed = asyncio.Event()
    started = b""
    if when == "after-its-head":  # its head and part of its body came, the rest never does
        started = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
    elif when == "mid-body":  # too long to be read whole first: relayed as it comes
        started = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (2 * WHOLE_BODY_BYTES, b"x" * 65536)
        )
    hostile.script.append(until_closed(closed, started))
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(generation_bytes("cut-1"))
    await gate.until(lambda: len(hostile.served()) == 1)
    await gate.until(lambda: gate.service.admission.active == 1)
    if when == "mid-body":
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
    stopping = None
    try:
        if how == "client-leaves":
            writer.close()
        elif how == "operator-cancels":
            told, control = await asyncio.open_connection("127.0.0.1", gate.port)
            control.write(b"POST /admin/requests/cut-1/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Length: 0\r\n\r\n")  # fmt: skip
            (status, _), _ = await read_answer(told, "POST")
            control.close()
            assert status == 200
        else:
            stopping = asyncio.create_task(gate.stop())
        async with asyncio.timeout(30):
            await closed.wait()
        if when == "mid-body" and how != "client-leaves":
            # Its head went out: it can only be left unfinished, which its client sees.
            async with asyncio.timeout(30):
                got = await reader.read()
            assert len(got) < 2 * WHOLE_BODY_BYTES
            await gate.until(lambda: gate.service.admission.active == 0)
        elif how == "operator-cancels":
            status, error = await error_of(reader)
            assert (status, error["code"]) == (503, "cancelled_by_operator")
            # Its slot went back before its client was told.
            assert gate.service.admission.active == 0
        elif how == "shutdown-drain-ends":
            status, error = await error_of(reader)
            assert (status, error["code"]) == (503, "shutting_down")
        else:
            await gate.until(lambda: gate.service.admission.active == 0)
    finally:
        writer.close()
        if stopping is not None:
            await stopping
    # Told, gone, or left unfinished (a plain answer cut after its head): the request ends
    # quietly, with no error of the app's in uvicorn's log.
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    if how != "shutdown-drain-ends":
        reason = "client_gone" if how == "client-leaves" else "cancelled"
        assert f'slotgate_requests_rejected_total{{family="chat",reason="{reason}"}} 1.0' in (
            await metrics_text(gate)
        )


OWN_ROUTES = ["/healthz", "/readyz", "/admission", "/metrics", "/status", "/v1/models", "/health"]


@pytest.mark.parametrize("keyed", [False, True])
async def test_slotgates_own_routes_and_refusals_answer_every_pipelined_request_framed(
    start_gate: GateFactory, hostile: Hostile, keyed: bool
) -> None:
    gate = await before_hostile(start_gate, hostile, **({"api_keys": "sk-a"} if keyed else {}))
    hostile.fallback = sends(reply(200, b'{"data":[]}'))
    asked = [(method, path) for path in OWN_ROUTES for method in ("GET", "HEAD")]
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        writer.write(b"".join(ask(method, path) for method, path in asked))
        answers = [await read_answer(reader, method) for method, _ in asked]
        # The last asks for the connection's end, and gets it after its answer.
        writer.write(ask("GET", "/healthz", b"Connection: close\r\n"))
        (status, headers), body = await read_answer(reader, "GET")
        assert (status, body) == (200, b'{"status":"ok"}')
        assert (b"connection", b"close") in headers
        async with asyncio.timeout(30):
            assert await reader.read() == b""
    finally:
        writer.close()
    by_path: dict[str, list[tuple[int, bytes]]] = {}
    for (method, path), ((status, headers), body) in zip(asked, answers, strict=True):
        names = [name for name, _ in headers]
        assert names.count(b"date") == 1, (method, path)
        assert b"x-request-id" in names, (method, path)
        if method == "HEAD":
            assert body == b"", path
        by_path.setdefault(path, []).append((status, body))
    # The status page itself is open; the data it reads (/admission) is not.
    open_paths = {"/healthz", "/readyz", "/health", "/status"}
    for path, [(got, _), (head, _)] in by_path.items():
        expected = 401 if keyed and path not in open_paths else 200
        assert got == expected, path
        # A HEAD is answered as its GET is, without the body; 405 where only GET is routed.
        assert head == (405 if path in ("/admission", "/metrics") else got), path
    assert by_path["/healthz"][1][0] == by_path["/readyz"][1][0] == 200


def writes_paused(gate: RunningGate) -> bool:
    """Some connection's client reads too slowly: uvicorn waits for its socket to drain."""
    return any(
        isinstance(c, Connection) and c.write_paused for c in gate.server.server_state.connections
    )


@pytest.mark.parametrize("then", ["reads-late", "resets"])
async def test_pipelined_whole_answers_to_a_client_that_does_not_read_wait_for_it_whole(
    start_gate: GateFactory, standin: StandIn, caplog: pytest.LogCaptureFixture, then: str
) -> None:
    # Each answer's head waits with its body for the client's socket to drain: what the held
    # head and the one write must keep intact, or let go of when the client resets.
    gate = await start_gate()
    bodies = [bytes([ord("a") + i % 26]) * 256 * 1024 for i in range(24)]
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        for body in bodies:
            writer.write(
                b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
        await gate.until(lambda: writes_paused(gate))
        if then == "resets":
            hang_up(writer, "reset")
            await gate.until(lambda: not gate.server.server_state.connections)
        else:
            for body in bodies:
                (status, _), got = await read_answer(reader, "POST")
                assert status == 200
                assert json.loads(got)["body"] == body.decode()  # the stand-in's echo
    finally:
        writer.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    fresh_reader, fresh = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        fresh.write(ask("GET", "/health"))
        (status, _), _ = await read_answer(fresh_reader, "GET")
        assert status == 200
    finally:
        fresh.close()


@pytest.mark.parametrize(
    "variant", ["expect-100-continue", "http-1.0", "http-1.0-keep-alive", "connection-close"]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_generation_over_any_connection_kind_is_answered_framed_and_ends_it_as_asked(
    start_gate: GateFactory, standin: StandIn, variant: str, stream: bool
) -> None:
    gate = await start_gate()
    body = json.dumps(chat(stream=stream)).encode()
    version, extra = b"1.1", b""
    if variant == "expect-100-continue":
        extra = b"Expect: 100-continue\r\n"
    elif variant.startswith("http-1.0"):
        version = b"1.0"
        extra = b"Connection: keep-alive\r\n" if variant.endswith("keep-alive") else b""
    elif variant == "connection-close":
        extra = b"Connection: close\r\n"
    head = (
        b"POST %s HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d"
        b"\r\n\r\n" % (CHAT.encode(), version, extra, len(body))
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        writer.write(head)
        if variant == "expect-100-continue":
            async with asyncio.timeout(30):
                interim = await reader.readuntil(b"\r\n\r\n")
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        (status, headers), got = await read_answer(reader, "POST")
        assert status == 200
        if stream:
            assert got.endswith(b"data: [DONE]\n\n")
        else:
            assert json.loads(got)["object"] == "chat.completion"
        # uvicorn ends every HTTP/1.0 connection after its answer, keep-alive asked or not.
        kept = variant == "expect-100-continue"
        assert ((b"connection", b"close") in headers) == (not kept)
        if kept:
            writer.write(ask("GET", "/health"))
            (status, _), _ = await read_answer(reader, "GET")
            assert status == 200
        else:
            async with asyncio.timeout(30):
                assert await reader.read() == b""
    finally:
        writer.close()
    assert gate.service.admission.active == 0


#: A chat stream kept open after its end, as llama-server may keep a connection.
KEPT_STREAM = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in CHAT_STREAM)
    + b"0\r\n\r\n"
)
COMPLETION = reply(200, b'{"object":"chat.completion","choices":[]}')


@pytest.mark.parametrize("upstream_as", ["sent", "stream"])
@pytest.mark.usefixtures("quiet_upstreams")
async def test_a_generation_relayed_to_its_end_gives_llama_servers_connection_to_the_next(
    start_gate: GateFactory, hostile: Hostile, upstream_as: str
) -> None:
    assembled = upstream_as == "stream"
    gate = await before_hostile(start_gate, hostile, stream_upstream=assembled)
    hostile.fallback = sends(KEPT_STREAM if assembled else COMPLETION)
    primary = gate.service.fleet.primary
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        for n in range(3):
            writer.write(generation_bytes(f"kept-{n}"))
            (status, _), body = await read_answer(reader, "POST")
            assert status == 200
            assert json.loads(body)["object"] == "chat.completion"
            if n == 0 and assembled:
                # The first stream's connection is held aside until slotgate has learned that
                # llama-server keeps such connections open; pooled from then on.
                await gate.until(lambda: primary.keeps_streams is not None)
                assert primary.keeps_streams
    finally:
        writer.close()
    generations = [r for r in hostile.served() if r.target == CHAT]
    assert [json.loads(r.body)["stream"] for r in generations] == [assembled] * 3
    assert len({r.connection for r in generations}) == 1
    assert gate.service.admission.active == 0


@pytest.mark.interpreted
async def test_an_unexpected_failure_before_the_head_is_a_500_that_ends_the_connection(
    start_gate: GateFactory, standin: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = await start_gate()

    def broken(path: str) -> str:
        raise RuntimeError("a bug")  # anywhere before the head, where no refusal is meant

    monkeypatch.setattr(relay_module, "checked_path", broken)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        writer.write(generation_bytes("bug-1") + ask("GET", "/health"))
        (status, headers), body = await read_answer(reader, "POST")
        async with asyncio.timeout(30):
            rest = await reader.read()
    finally:
        writer.close()
    assert (status, body) == (500, b"Internal Server Error")
    # uvicorn's own answer asks for the close itself: said once, and done, the request
    # pipelined behind it unanswered.
    assert [v for n, v in headers if n == b"connection"] == [b"close"]
    assert rest == b""


async def test_a_client_that_resets_while_its_generations_answers_wait_to_drain_frees_every_slot(
    start_gate: GateFactory, hostile: Hostile, caplog: pytest.LogCaptureFixture
) -> None:
    # Whole answers of 900 KB, pipelined: one waits in its head's drain, the next in line.
    big = b'{"object":"chat.completion","pad":"' + b"x" * 900 * 1024 + b'"}'
    gate = await before_hostile(start_gate, hostile, stream_upstream=False)
    hostile.fallback = sends(reply(200, big))
    _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        writer.write(b"".join(generation_bytes(f"big-{n}") for n in range(8)))
        await gate.until(lambda: writes_paused(gate))
        hang_up(writer, "reset")
        await gate.until(lambda: not gate.server.server_state.connections)
        await gate.until(lambda: gate.service.admission.active == 0)
    finally:
        writer.close()
    assert gate.service.admission.queued == 0
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in (await metrics_text(gate)).splitlines()
        if line.startswith("slotgate_")
    }
    admitted = values['slotgate_requests_admitted_total{family="chat"}']
    served = values['slotgate_request_duration_seconds_count{family="chat"}']
    gone = values['slotgate_requests_rejected_total{family="chat",reason="client_gone"}']
    # Those whose answers the kernel took were served; the one in flight (in its head's drain,
    # nearly always) ended as its client's leaving; each counted once, none left holding.
    assert gone <= 1
    assert 0 <= admitted - served <= gone
    assert 1 <= served <= 8 - gone


@pytest.mark.parametrize("path", ["/slots", CHAT])
async def test_a_status_past_http_s_range_from_llama_server_is_a_502_not_a_dropped_connection(
    start_gate: GateFactory, hostile: Hostile, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    # httptools reads any three digits as a status; uvicorn has a status line for 100 to 599
    # only, and a head it cannot build drops the connection with no answer at all.
    gate = await before_hostile(start_gate, hostile, stream_upstream=False)
    hostile.fallback = sends(b"HTTP/1.1 799 Odd\r\nContent-Length: 2\r\n\r\n{}")
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    try:
        writer.write(generation_bytes("odd-1") if path == CHAT else ask("GET", path))
        status, error = await error_of(reader)
        assert (status, error["code"]) == (502, "upstream_failed")
        assert "799" in error["message"]
        # The client's connection goes on.
        hostile.fallback = sends(reply(200, b'{"status":"ok"}'))
        writer.write(ask("GET", "/health"))
        (status, _), _ = await read_answer(reader, "GET")
        assert status == 200
    finally:
        writer.close()
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert gate.service.admission.active == 0
