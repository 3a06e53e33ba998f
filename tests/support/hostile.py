"""A hostile stand-in llama-server: raw HTTP/1.1 on asyncio that misbehaves on demand.

`GET /props` is answered properly (so slotgate sees a ready server), `GET /metrics` as by a
llama-server without `--metrics` (501, read once when slotgate first sees it ready); every
other request gets
the next answer in `script`, or `fallback` once the script is empty. An answer writes whatever
it likes to the connection: a response too many, bytes on an idle connection, a head of
megabytes, an endless error body, 1xx before the real answer, a 101, a stream cut mid-event.

    python -m tests.support.hostile --port 9100 --answer huge_head

serves one misbehaviour for every request, for measuring slotgate from outside, except that a
request with the query `?hold` gets a proper stream `--hold-s` seconds late: it holds a slot
while a stream sent meanwhile waits in line (its head out) for the misbehaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import select
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

MiB = 1024 * 1024

#: Answered by the server itself, never from the script.
_OWN = frozenset({"/props", "/metrics"})
_NO_METRICS = (
    b'{"error":{"code":501,"message":"This server does not support metrics endpoint.",'
    b'"type":"not_supported_error"}}'
)


@dataclass
class Request:
    """One request as the hostile upstream read it."""

    method: str
    target: str
    headers: dict[bytes, bytes]  # names in lower case
    body: bytes
    connection: int  # the connection it came on, numbered from 1 in order of acceptance


class Peer:
    """The connection an answer writes to."""

    def __init__(self, hostile: Hostile, writer: asyncio.StreamWriter, number: int) -> None:
        self.hostile = hostile
        self.number = number
        self._writer = writer
        self.closed = False

    async def write(self, data: bytes) -> None:
        """Write and wait for the socket to take it; a peer that left ends the answer quietly."""
        if self.closed:
            return
        try:
            self._writer.write(data)
            await self._writer.drain()
        except ConnectionError:
            self.closed = True
            return
        self.hostile.sent += len(data)

    async def write_repeated(self, piece: bytes, total: int) -> None:
        """`total` bytes made of `piece` over and over, written as the reader takes them."""
        while total > 0 and not self.closed:
            part = piece if total >= len(piece) else piece[:total]
            await self.write(part)
            total -= len(part)

    def write_now(self, data: bytes) -> None:
        """Straight into the kernel, past the loop: there before the loop's next turn."""
        fd = self._writer.get_extra_info("socket").fileno()
        with socket.socket(fileno=os.dup(fd)) as raw:
            raw.sendall(data)

    def close(self) -> None:
        self.closed = True
        self._writer.close()

    def hung_up(self) -> bool:
        """Has the other end closed the connection? Asked of the kernel, for an answer that
        waits while slotgate holds the connection (its request read whole, anything readable
        is the end)."""
        poll = select.poll()
        poll.register(
            self._writer.get_extra_info("socket").fileno(), select.POLLIN | select.POLLRDHUP
        )
        return bool(poll.poll(0))

    def abort(self) -> None:
        """Drop the connection now, whatever is still buffered for it."""
        self.closed = True
        self._writer.transport.abort()


Answer = Callable[[Peer, Request], Awaitable[None]]


def reply(status: int = 200, body: bytes = b"", headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A complete response with a Content-Length."""
    head = [f"HTTP/1.1 {status} Hostile", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in headers]
    if body and not any(name.lower() == "content-type" for name, _ in headers):
        head.append("Content-Type: application/json")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def sends(*parts: bytes | float) -> Answer:
    """Write each bytes part in its own write; a number is a pause of that many seconds."""

    async def answer(peer: Peer, _: Request) -> None:
        for part in parts:
            if isinstance(part, bytes):
                await peer.write(part)
            else:
                await asyncio.sleep(part)

    return answer


def closes(answer: Answer) -> Answer:
    """The answer, then the connection closed."""

    async def closing(peer: Peer, request: Request) -> None:
        await answer(peer, request)
        peer.close()

    return closing


def held(release: asyncio.Event, answer: Answer) -> Answer:
    """The answer once `release` is set: keeps a slot busy for as long as a test wants."""

    async def holding(peer: Peer, request: Request) -> None:
        await release.wait()
        await answer(peer, request)

    return holding


def late(delay_s: float, answer: Answer) -> Answer:
    """The answer, `delay_s` seconds late."""

    async def later(peer: Peer, request: Request) -> None:
        await asyncio.sleep(delay_s)
        await answer(peer, request)

    return later


def huge_head(size: int = 20 * MiB) -> Answer:
    """A 200 whose head never ends within `size` bytes: one header line that goes on and on."""

    async def answer(peer: Peer, _: Request) -> None:
        await peer.write(b"HTTP/1.1 200 OK\r\nX-Padding: ")
        await peer.write_repeated(b"a" * 65536, size)
        await peer.write(b"\r\nContent-Length: 0\r\n\r\n")

    return answer


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def huge_error(size: int = 200 * MiB, status: int = 500, *, chunked: bool = False) -> Answer:
    """An error whose JSON body is `size` bytes long, written as the reader takes it; with
    `chunked`, in chunks of 64 KiB and no length declared up front."""

    async def answer(peer: Peer, _: Request) -> None:
        start = b'{"error":{"code":500,"type":"server_error","message":"'
        end = b'"}}'
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
        head = f"HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
        piece = b"x" * 65536
        if chunked:
            await peer.write(head.encode() + _chunk(start))
            await peer.write_repeated(_chunk(piece), size // len(piece) * len(_chunk(piece)))
            await peer.write(_chunk(end) + b"0\r\n\r\n")
        else:
            await peer.write(head.encode() + start)
            await peer.write_repeated(piece, size - len(start) - len(end))
            await peer.write(end)

    return answer


def event(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n"
)


def stream(*events: bytes, cut: bytes | None = None) -> Answer:
    """An event stream, chunked as llama-server sends it, one chunk per event. With `cut`,
    those bytes are the last chunk and the connection closes without ending the body."""

    async def answer(peer: Peer, _: Request) -> None:
        await peer.write(SSE_HEAD)
        for data in events:
            await peer.write(_chunk(data))
        if cut is not None:
            await peer.write(_chunk(cut))
        else:
            await peer.write(b"0\r\n\r\n")
        peer.close()

    return answer


#: A chat stream as llama-server sends one, short.
CHAT_STREAM = (
    event({"choices": [{"delta": {"role": "assistant", "content": None}, "index": 0}]}),
    event({"choices": [{"delta": {"content": "one"}, "index": 0}]}),
    event({"choices": [{"delta": {}, "finish_reason": "stop", "index": 0}]}),
    b"data: [DONE]\n\n",
)
#: What a stream cut in the middle of an event left behind.
PARTIAL_EVENT = b'data: {"choices":[{"delta":{"content":"t'


def ok(body: bytes = b'{"ok":true}') -> Answer:
    return sends(reply(200, body))


@dataclass
class Hostile:
    """The server; set `script` (and `fallback`) from a test, read `requests` and `sent` after."""

    total_slots: int = 1
    host: str = "127.0.0.1"
    script: deque[Answer] = field(default_factory=deque)
    fallback: Answer = field(default_factory=ok)
    props: Answer | None = None  # answers GET /props instead of the proper answer when set
    requests: list[Request] = field(default_factory=list)
    sent: int = 0  # bytes the sockets took, over all connections
    peers: dict[int, Peer] = field(default_factory=dict)  # by connection number
    port: int = 0
    _server: asyncio.Server | None = None
    _numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _peers: set[asyncio.Task[None]] = field(default_factory=set)
    _stopping: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def served(self) -> list[Request]:
        """The requests answered from the script or the fallback (not /props nor /metrics)."""
        return [r for r in self.requests if r.target not in _OWN]

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._stopping = True
            self._server.close()
            for peer in self.peers.values():
                peer.abort()
            tasks = list(self._peers)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # a server callback runs in a task
        self._peers.add(task)
        peer = Peer(self, writer, next(self._numbers))
        self.peers[peer.number] = peer
        try:
            while not peer.closed:
                request = await _read_request(reader, peer.number)
                self.requests.append(request)
                if request.method == "GET" and request.target == "/props":
                    if self.props is not None:
                        await self.props(peer, request)
                    else:
                        await peer.write(reply(200, self._props()))
                    continue
                if request.method == "GET" and request.target == "/metrics":
                    await peer.write(reply(501, _NO_METRICS))
                    continue
                answer = self.script.popleft() if self.script else self.fallback
                await answer(peer, request)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except asyncio.CancelledError:
            # Cancelled by stop(): ending quietly, since asyncio's stream server reports a
            # cancelled handler as an unhandled exception.
            if not self._stopping:
                raise
        finally:
            self._peers.discard(task)
            writer.close()

    def _props(self) -> bytes:
        return json.dumps(
            {
                "total_slots": self.total_slots,
                "default_generation_settings": {"n_ctx": 2048},
                "model_alias": "hostile",
                "build_info": "hostile",
            }
        ).encode()


async def _read_request(reader: asyncio.StreamReader, number: int) -> Request:
    head = await reader.readuntil(b"\r\n\r\n")
    line, *fields = head.decode("latin-1").split("\r\n")
    method, target, _ = line.split(" ", 2)
    headers: dict[bytes, bytes] = {}
    for header in fields:
        if header:
            name, _, value = header.partition(":")
            headers[name.strip().lower().encode("latin-1")] = value.strip().encode("latin-1")
    length = int(headers.get(b"content-length", b"0"))
    body = await reader.readexactly(length) if length else b""
    return Request(method, target, headers, body, number)


def giant_stream(size: int = 200 * MiB) -> Answer:
    """A chat stream of `size` bytes of content, events of 64 KiB, written as the reader takes
    them: what an assembled answer must not hold whole."""
    delta = event({"choices": [{"delta": {"content": "x" * (64 * 1024)}, "index": 0}]})

    async def answer(peer: Peer, _: Request) -> None:
        await peer.write(SSE_HEAD + _chunk(CHAT_STREAM[0]))
        await peer.write_repeated(_chunk(delta), size // len(delta) * len(_chunk(delta)))
        await peer.write(_chunk(CHAT_STREAM[-1]) + b"0\r\n\r\n")
        peer.close()

    return answer


#: Misbehaviours by name, for the command line.
ANSWERS: dict[str, Callable[[], Answer]] = {
    "huge_head": huge_head,
    "huge_error": huge_error,
    "extra_response": lambda: sends(reply(200, b'{"n":1}') + reply(200, b'{"n":"extra"}')),
    "interim": lambda: sends(b"HTTP/1.1 100 Continue\r\n\r\n", reply(200, b'{"ok":true}')),
    "switching": lambda: sends(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"),
    "cut_mid_event": lambda: stream(*CHAT_STREAM[:2], cut=PARTIAL_EVENT),
    "giant_stream": giant_stream,
}


async def _main(port: int, name: str, total_slots: int, hold_s: float) -> None:
    misbehaviour, holding = ANSWERS[name](), late(hold_s, stream(*CHAT_STREAM))

    async def answer(peer: Peer, request: Request) -> None:
        await (holding if request.target.endswith("?hold") else misbehaviour)(peer, request)

    hostile = Hostile(total_slots=total_slots, fallback=answer)
    await hostile.start(port)
    print(f"hostile upstream on {hostile.url}, answering {name}", flush=True)  # noqa: T201
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--answer", choices=sorted(ANSWERS), default="huge_head")
    parser.add_argument("--total-slots", type=int, default=2)
    parser.add_argument("--hold-s", type=float, default=1.0)
    arguments = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(
            _main(arguments.port, arguments.answer, arguments.total_slots, arguments.hold_s)
        )
