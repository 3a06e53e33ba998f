"""The floor under slotgate: uvicorn, configured as `slotgate` runs it, with an ASGI app that
does nothing a gate does.

- `--answer`: every request is answered at once with the stand-in's non-streamed completion,
  no upstream: what uvicorn alone costs per request (scenario 1's `uvicorn-bare`).
- `--relay UPSTREAM_PORT`: every request is relayed to the stand-in on UPSTREAM_PORT over a
  pooled keep-alive connection, and its answer sent back whole: what relaying costs in uvicorn
  with nothing a gate does (no admission, no checks, no timeouts, no metrics, no error
  answers), the floor under any relay run by uvicorn (scenario 1's `uvicorn-relay`).
- otherwise every request is held open until its client leaves: what a waiting request costs
  in uvicorn alone (scenario 4). `GET /held` says how many are held.

Run it as `python -m bench.floor --port P [--answer | --relay UPSTREAM_PORT]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httptools
import uvicorn

from tests.support.standin import BENCH, StandIn

held = 0
_OK = [(b"content-type", b"application/json")]


async def _lifespan(receive: Any, send: Any) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def hold(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global held
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["path"] in ("/readyz", "/held"):
        await send({"type": "http.response.start", "status": 200, "headers": _OK})
        await send({"type": "http.response.body", "body": json.dumps({"held": held}).encode()})
        return
    held += 1
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    finally:
        held -= 1


# The stand-in's own answer (16 tokens), without its HTTP head.
_COMPLETION = StandIn(**BENCH).answer("completion").split(b"\r\n\r\n", 1)[1]
_ANSWER_HEAD = [*_OK, (b"content-length", str(len(_COMPLETION)).encode())]


async def answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": _ANSWER_HEAD})
    await send({"type": "http.response.body", "body": _COMPLETION})


class _Upstream(asyncio.Protocol):
    """One keep-alive connection to the stand-in: a response parsed with httptools (as
    slotgate's upstream client parses it), its head and body kept for the one request."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the stand-in closed the connection"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.done is not None:
            self.done.set_result(None)


_idle: list[_Upstream] = []
_upstream_port = 0
#: What the relay passes on of the stand-in's head (its date and server are the stand-in's).
_PASSED = (b"content-type", b"content-length")


async def relay(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["path"] == "/readyz":
        await send({"type": "http.response.start", "status": 200, "headers": _OK})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    pieces: list[bytes] = []
    more = True
    while more:
        message = await receive()
        pieces.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(pieces)
    loop = asyncio.get_running_loop()
    if _idle:
        upstream = _idle.pop()
    else:
        _, upstream = await loop.create_connection(_Upstream, "127.0.0.1", _upstream_port)
    upstream.done = loop.create_future()
    upstream.headers = []
    upstream.body = []
    assert upstream.transport is not None  # set by connection_made
    upstream.transport.write(
        b"%s %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s"
        % (scope["method"].encode(), scope["raw_path"], len(body), body)
    )
    await upstream.done
    _idle.append(upstream)
    head = [(name, value) for name, value in upstream.headers if name in _PASSED]
    await send({"type": "http.response.start", "status": upstream.status, "headers": head})
    await send({"type": "http.response.body", "body": b"".join(upstream.body)})


def main() -> None:
    global _upstream_port
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--answer", action="store_true", help="answer at once; hold otherwise")
    parser.add_argument("--relay", type=int, metavar="UPSTREAM_PORT", help="relay to this port")
    args = parser.parse_args()
    _upstream_port = args.relay or 0
    app = relay if args.relay else answer if args.answer else hold
    # The options app/cli.py gives uvicorn.
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, loop="uvloop",
        http="httptools", lifespan="on", access_log=False, server_header=False,
        proxy_headers=False, log_level="warning",
    )  # fmt: skip


if __name__ == "__main__":
    main()
