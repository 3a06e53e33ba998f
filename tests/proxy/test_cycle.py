"""slotgate's request cycle: the answer's head it builds and the whole answer it writes at once,
held to what uvicorn's own cycle writes and leaves behind."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
import pytest
import uvicorn
from hypothesis import event, given
from hypothesis import strategies as st
from slotgate.proxy.answer import BODY_FOLLOWS, CHECKED_HEADERS
from slotgate.proxy.cycle import Cycle
from slotgate.proxy.protocol import Connection
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, RequestResponseCycle
from uvicorn.server import ServerState

from tests.conftest import CHAT


class _Wire:
    """A transport that records what is done to it, in order."""

    def __init__(self) -> None:
        self.done: list[bytes | str] = []

    def write(self, data: bytes) -> None:
        self.done.append(bytes(data))

    def close(self) -> None:
        self.done.append("close")

    def is_closing(self) -> bool:
        return "close" in self.done


class _State(ServerState):
    """uvicorn's server state, whose count of answered requests records each answer's end on
    the wire: the one trace of the cycle telling its connection, in order with the writes."""

    def __init__(self, wire: _Wire) -> None:
        self._wire = wire
        self._answered = 0
        super().__init__()

    @property
    def total_requests(self) -> int:
        return self._answered

    @total_requests.setter
    def total_requests(self, count: int) -> None:
        if count:
            self._wire.done.append("on_response")
        self._answered = count


async def _app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("not run")


def _cycle(
    wire: _Wire,
    *,
    keep_alive: bool = True,
    method: str = "POST",
    default: list[tuple[bytes, bytes]] | None = None,
    kind: type[Cycle | RequestResponseCycle] = Cycle,
) -> Any:
    transport: Any = wire
    scope: Any = {"method": method, "path": CHAT, "http_version": "1.1"}
    if kind is RequestResponseCycle:
        return RequestResponseCycle(
            scope, transport, FlowControl(transport), logging.getLogger("test"),
            logging.getLogger("test.access"), False, default or [], asyncio.Event(), False,
            keep_alive, lambda: wire.done.append("on_response"),
        )  # fmt: skip
    state = _State(wire)
    state.default_headers = default or []
    connection = Connection(uvicorn.Config(_app, log_config=None), state, {})
    connection.transport = transport
    return Cycle(connection, scope, keep_alive, False)


def _woken(cycle: Any) -> bool:
    """Something is there for the cycle's `receive` to see (its answer's end, here)."""
    return bool(cycle.ready) if isinstance(cycle, Cycle) else cycle.message_event.is_set()


def _start(length: int, *, whole: bool) -> dict[str, Any]:
    headers = [(b"content-length", str(length).encode())]
    message: dict[str, Any] = {"type": "http.response.start", "status": 200, "headers": headers}
    if whole:
        message[BODY_FOLLOWS] = True
    return message


async def test_a_whole_answer_goes_out_in_one_write_and_any_other_in_order() -> None:
    end = {"type": "http.response.body", "body": b"hello", "more_body": False}
    joined, plain = _Wire(), _Wire()
    for wire, whole in ((joined, True), (plain, False)):
        cycle = _cycle(wire)
        await cycle.send(_start(5, whole=whole))
        await cycle.send(end)
    assert len(joined.done) == 2
    assert isinstance(joined.done[0], bytes)
    assert joined.done[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert joined.done[0].endswith(b"\r\n\r\nhello")
    assert joined.done[1] == "on_response"
    assert plain.done == [joined.done[0][:-5], b"hello", "on_response"]
    # A close right after the body (the client asked for one) comes after both.
    closing = _Wire()
    cycle = _cycle(closing, keep_alive=False)
    await cycle.send(_start(5, whole=True))
    await cycle.send(end)
    assert closing.done[1:] == ["close", "on_response"]
    assert isinstance(closing.done[0], bytes)
    # A body uvicorn refuses before writing it still lets the held head out.
    refused = _Wire()
    cycle = _cycle(refused)
    await cycle.send(_start(2, whole=True))
    with pytest.raises(RuntimeError, match="longer than Content-Length"):
        await cycle.send(end)
    assert len(refused.done) == 1
    assert isinstance(refused.done[0], bytes)
    assert refused.done[0].endswith(b"\r\n\r\n")


_HEADS = [
    pytest.param("POST", 200, [(b"content-length", b"5")], id="a-length"),
    pytest.param(
        "POST", 200, [(b"Content-Type", b"text/plain"), (b"Content-Length", b"5")],
        id="names-with-capitals",
    ),
    pytest.param("POST", 200, [(b"transfer-encoding", b"Chunked")], id="chunked"),
    pytest.param("POST", 200, [(b"content-type", b"text/event-stream")], id="no-length"),
    pytest.param("HEAD", 200, [], id="a-head-request"),
    pytest.param("POST", 204, [], id="no-content"),
    pytest.param(
        "POST", 200, [(b"connection", b"Keep-Alive, CLOSE"), (b"content-length", b"0")],
        id="a-close-asked-for",
    ),
    pytest.param("POST", 418, [(b"x-a", b"1"), (b"x-b", b""), (b"x-c", b"a\tb")], id="odd-values"),
    pytest.param(
        "POST", 200,
        [(b"content-type", b"text/plain"), (b"x-request-id", b"r1"), (b"content-length", b"7")],
        id="several-lowercase-with-a-length",
    ),
    pytest.param(
        "POST", 200, [(b"content-length", b"7"), (b"content-length", b"9")], id="two-lengths"
    ),
    pytest.param(
        "POST", 200, [(b"x-content-length", b"3"), (b"content-length", b"7")],
        id="another-name-ending-in-length",
    ),
    pytest.param(
        "POST", 200, [(b"content-length", b"7"), (b"connection", b"close")],
        id="a-length-and-a-close",
    ),
    pytest.param(
        "POST", 200, [(b"-", b"1"), (b"content-length", b"0")], id="a-name-without-letters"
    ),
]  # fmt: skip


@pytest.mark.parametrize(("method", "status", "headers"), _HEADS)
@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("checked", [False, True], ids=["checked-here", "checked-before"])
async def test_an_answers_head_is_the_one_uvicorn_builds_and_leaves_the_same_state(
    method: str, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool, checked: bool
) -> None:
    ours, uvicorns = _Wire(), _Wire()
    cycles = [
        _cycle(wire, keep_alive=keep_alive, method=method, default=[(b"date", b"today")], kind=kind)
        for wire, kind in ((ours, Cycle), (uvicorns, RequestResponseCycle))
    ]
    for cycle in cycles:
        message = {"type": "http.response.start", "status": status, "headers": headers}
        if checked and isinstance(cycle, Cycle):
            message[CHECKED_HEADERS] = True
        await cycle.send(message)
    assert ours.done == uvicorns.done
    assert len(ours.done) == 1
    for state in (
        "response_started", "chunked_encoding", "expected_content_length", "keep_alive",
        "waiting_for_100_continue",
    ):  # fmt: skip
        assert getattr(cycles[0], state) == getattr(cycles[1], state), state


@pytest.mark.parametrize(
    "headers",
    [
        [(b"x bad", b"1")],
        [(b"x-a:", b"1")],
        [(b"x\r\n", b"1")],
        [(b"x-a", b"1\r\nx-b: 2")],
        [(b"x-a", b"1\nx-b: 2")],
        [(b"x-a", b"1\r")],
        [(b"x-a", b"\x00")],
        [(b"x-a", b"\x7f")],
        [(b"x-ok", b"1"), (b"x-a", b"a\x0bb")],
    ],
)
async def test_a_header_uvicorn_refuses_is_refused_alike_and_nothing_is_written(
    headers: list[tuple[bytes, bytes]],
) -> None:
    said = []
    for kind in (Cycle, RequestResponseCycle):
        wire = _Wire()
        with pytest.raises(RuntimeError) as raised:
            await _cycle(wire, kind=kind).send(
                {"type": "http.response.start", "status": 200, "headers": headers}
            )
        said.append(str(raised.value))
        assert wire.done == []
    assert said[0] == said[1]


class _Headers:
    """What httptools' parser hands on of a message's headers."""

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.seen.append((name, value))


def _parsed(name: bytes, value: bytes, *, request: bool) -> list[tuple[bytes, bytes]] | None:
    """The headers httptools hands on of a message with one header `name: value` (None: the
    parser refused the message, so nothing of it is relayed)."""
    headers = _Headers()
    start = b"POST / HTTP/1.1\r\n" if request else b"HTTP/1.1 200 OK\r\n"
    parser = (httptools.HttpRequestParser if request else httptools.HttpResponseParser)(headers)
    try:
        parser.feed_data(start + name + b":" + value + b"\r\ncontent-length: 0\r\n\r\n")
    except httptools.HttpParserError:
        return None
    return headers.seen


def _passes_uvicorns_checks(headers: list[tuple[bytes, bytes]]) -> bool:
    return not any(HEADER_RE.search(n) or HEADER_VALUE_RE.search(v) for n, v in headers)


@pytest.mark.parametrize("request_", [True, False], ids=["a-request", "an-answer"])
def test_every_header_httptools_parses_passes_the_checks_uvicorn_makes_of_an_answers_head(
    request_: bool,
) -> None:
    """Why an Answer's head skips them (`CHECKED_HEADERS`): its headers are llama-server's
    and the client's as httptools parsed them, or slotgate's own constants and numbers. Each
    byte inside a name and inside a value: parsed only where the checks pass it."""
    parsed = 0
    for byte in range(256):
        for name, value in (
            (b"x" + bytes([byte]) + b"y", b"v"),
            (b"x", b"a" + bytes([byte]) + b"b"),
        ):
            headers = _parsed(name, value, request=request_)
            if headers is not None:
                parsed += 1
                assert _passes_uvicorns_checks(headers), (name, value, headers)
    # Tokens' bytes in a name, and tabs, spaces and visible bytes in a value (a check that
    # parses nothing would prove nothing).
    assert parsed > 256


_TOKEN = b"abcXYZ09-_!#$%&'*+.^`|~"
_EDGES = b' \t\r\n\x00\x01\x0b\x1f\x7f\x80\xff:;,()/@[]={}"?'


@given(
    name=st.lists(st.sampled_from(_TOKEN) | st.sampled_from(_EDGES), min_size=1, max_size=5),
    value=st.lists(st.sampled_from(_TOKEN) | st.sampled_from(_EDGES), max_size=6),
    request_=st.booleans(),
)
def test_headers_httptools_parses_from_odd_bytes_together_pass_uvicorns_checks_too(
    name: list[int], value: list[int], request_: bool
) -> None:
    headers = _parsed(bytes(name), bytes(value), request=request_)
    event("parsed" if headers is not None else "refused")
    if headers is not None:
        assert _passes_uvicorns_checks(headers), headers


_WHOLE = [
    pytest.param("POST", [(b"content-length", b"5")], b"hello", id="its-length"),
    pytest.param("HEAD", [(b"content-length", b"5")], b"", id="a-head-request"),
    pytest.param("POST", [(b"content-type", b"text/plain")], b"hello", id="chunked"),
    pytest.param("POST", [(b"content-length", b"0")], b"", id="empty"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "headers", "body"), _WHOLE)
@pytest.mark.parametrize("keep_alive", [True, False])
async def test_a_whole_answer_ends_as_uvicorn_ends_one_in_one_write(
    method: str, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool
) -> None:
    ours, uvicorns = _Wire(), _Wire()
    cycles = [
        _cycle(wire, keep_alive=keep_alive, method=method, kind=kind)
        for wire, kind in ((ours, Cycle), (uvicorns, RequestResponseCycle))
    ]
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    end = {"type": "http.response.body", "body": body, "more_body": False}
    for cycle in cycles:
        await cycle.send({**start, BODY_FOLLOWS: True} if cycle is cycles[0] else start)
        await cycle.send(end)
    # The same bytes, and then the same close if any: uvicorn's in two writes, ours in one.
    assert b"".join(d for d in ours.done if isinstance(d, bytes)) == b"".join(
        d for d in uvicorns.done if isinstance(d, bytes)
    )
    assert [d for d in ours.done if isinstance(d, str)] == [
        d for d in uvicorns.done if isinstance(d, str)
    ]
    assert len([d for d in ours.done if isinstance(d, bytes)]) == 1
    for state in ("response_complete", "expected_content_length", "keep_alive"):
        assert getattr(cycles[0], state) == getattr(cycles[1], state), state
    assert _woken(cycles[0])
    assert _woken(cycles[1])


@pytest.mark.parametrize("body", [b"hel", b"hello!"], ids=["short", "long"])
async def test_a_whole_answer_of_another_length_than_its_head_said_fails_as_in_uvicorn(
    body: bytes,
) -> None:
    said = []
    for kind in (Cycle, RequestResponseCycle):
        wire = _Wire()
        cycle = _cycle(wire, kind=kind)
        await cycle.send(_start(5, whole=kind is Cycle))
        with pytest.raises(RuntimeError) as raised:
            await cycle.send({"type": "http.response.body", "body": body, "more_body": False})
        said.append((str(raised.value), b"".join(d for d in wire.done if isinstance(d, bytes))))
    assert said[0] == said[1]


async def test_a_body_of_many_pieces_is_received_whole_and_in_order() -> None:
    cycle = _cycle(_Wire())
    sent = [b"%d," % i for i in range(50)]
    for piece in sent[:30]:
        cycle.take_body(piece)
    first = await cycle.receive()
    for piece in sent[30:]:
        cycle.take_body(piece)
    cycle.more_body = False
    cycle.wake()
    second = await cycle.receive()
    assert (first["body"], first["more_body"]) == (b"".join(sent[:30]), True)
    assert (second["body"], second["more_body"]) == (b"".join(sent[30:]), False)
    assert isinstance(second["body"], bytes)
