"""A stand-in llama-server of negligible cost: a raw asyncio protocol with canned answers.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length request bodies, chunked SSE
answers) to serve `/props`, non-streamed and streamed chat completions, and two control
routes the bench uses: `POST /_bench/config` and `GET /_bench/stats`.

Every streamed token carries, as its content, the monotonic clock in nanoseconds at the
moment it was written, so a client on the same machine can tell how long each chunk spent
in the proxy between the two. For scenario 3b it records how long a finished generation's
slot stays empty before the next generation arrives.

Run it as `python -m bench.standin --port P`; `--port` again for more upstreams in the same
process, each port with its own slots, knobs and counters (the fleet scenarios' cheap fleet).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import re
import time
from typing import Any, cast

from bench.loop import run_loop

_STREAM = re.compile(rb'"stream"\s*:\s*true')


class State:
    """Behaviour knobs (set by the bench through /_bench/config) and what was recorded."""

    def __init__(self) -> None:
        self.slots = 1024
        self.tokens = 16
        self.token_delay_s = 0.0
        self.hold_s = 0.0
        self.record_gaps = False
        self.running = 0
        self.started = 0
        self.finished = 0
        #: Generation-seconds spent (running integrated over time) and the most at once.
        self.busy_ns = 0
        self.peak = 0
        self._changed_ns = time.monotonic_ns()
        self.free_since: collections.deque[int] = collections.deque()
        self.gaps_ns: list[int] = []
        self.streams: set[Connection] = set()
        self._ticking = False
        self.completion = b""
        self.rebuild()

    def configure(self, values: dict[str, Any]) -> None:
        self.slots = int(values.get("slots", self.slots))
        self.tokens = max(1, int(values.get("tokens", self.tokens)))
        self.token_delay_s = float(values.get("token_delay_s", self.token_delay_s))
        self.hold_s = float(values.get("hold_s", self.hold_s))
        self.record_gaps = bool(values.get("record_gaps", self.record_gaps))
        self.free_since.clear()
        self.gaps_ns = []
        self.started = self.finished = 0
        self.busy_ns = 0
        self.peak = self.running
        self._changed_ns = time.monotonic_ns()
        self.rebuild()

    def rebuild(self) -> None:
        body = json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": 1700000000,
                "model": "bench",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "tok " * self.tokens},
                    }
                ],
                "usage": {
                    "prompt_tokens": 3,
                    "completion_tokens": self.tokens,
                    "total_tokens": 3 + self.tokens,
                },
            },
            separators=(",", ":"),
        ).encode()
        self.completion = _head(200, b"application/json", len(body)) + body

    # -- generations ---------------------------------------------------------------------------

    def _account(self) -> None:
        now = time.monotonic_ns()
        self.busy_ns += self.running * (now - self._changed_ns)
        self._changed_ns = now

    def begin(self) -> None:
        self._account()
        self.running += 1
        self.started += 1
        self.peak = max(self.peak, self.running)
        if self.record_gaps and self.free_since:
            # The oldest freed slot is the one this arrival fills: FIFO matches llama-server,
            # which hands a free slot to the next task in its own order.
            self.gaps_ns.append(time.monotonic_ns() - self.free_since.popleft())

    def end(self) -> None:
        self._account()
        self.running -= 1
        self.finished += 1
        if self.record_gaps:
            self.free_since.append(time.monotonic_ns())

    # -- the token clock -----------------------------------------------------------------------

    def stream(self, conn: Connection) -> None:
        self.streams.add(conn)
        if not self._ticking:
            self._ticking = True
            loop = asyncio.get_running_loop()
            loop.call_at(loop.time() + self.token_delay_s, self._tick, loop.time())

    def _tick(self, scheduled: float) -> None:
        # One timer drives every stream, like one llama.cpp decode step yields one token for
        # every busy slot: it keeps the stand-in's own cost per chunk to a write.
        for conn in list(self.streams):
            conn.next_token()
        if not self.streams:
            self._ticking = False
            return
        loop = asyncio.get_running_loop()
        due = scheduled + self.token_delay_s
        now = loop.time()
        if due < now:  # fell behind: skip the missed ticks rather than burst to catch up
            due = now + self.token_delay_s
        loop.call_at(due, self._tick, due)


def _head(status: int, content_type: bytes, length: int) -> bytes:
    reason = {200: b"OK", 404: b"Not Found", 400: b"Bad Request"}.get(status, b"OK")
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
        status,
        reason,
        content_type,
        length,
    )


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"X-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n\r\n"
)
_TOKEN_PREFIX = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":"'
)
_TOKEN_SUFFIX = b' "},"finish_reason":null}]}\n\n'
_FINISH = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _token() -> bytes:
    return _chunk(_TOKEN_PREFIX + b"%d" % time.monotonic_ns() + _TOKEN_SUFFIX)


_END = _chunk(_FINISH) + b"0\r\n\r\n"


class Connection(asyncio.Protocol):
    """One client connection; requests on it are answered one at a time, in order."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a generation is running on this connection
        self.left = 0  # tokens still to send on the running stream
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, though they implement it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.busy:
            # A client that leaves frees its slot, as llama-server cancels the task.
            self.state.streams.discard(self)
            self.busy = False
            self.state.end()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._parse()

    def _parse(self) -> None:
        buffer = self.buffer
        while not self.busy and self.transport is not None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : stop if stop >= 0 else None])
            total = end + 4 + length
            if len(buffer) < total:
                return
            body = bytes(buffer[end + 4 : total])
            target = bytes(buffer[: buffer.find(b"\r\n")]).split(b" ")
            del buffer[:total]
            self.keep_alive = b"\r\nconnection: close" not in head
            self._handle(target[0], target[1] if len(target) > 1 else b"/", body)

    def _send(self, data: bytes) -> None:
        if self.transport is None:
            return
        self.transport.write(data)
        if not self.keep_alive:
            self.transport.close()

    def _json(self, value: Any, status: int = 200) -> None:
        body = json.dumps(value).encode()
        self._send(_head(status, b"application/json", len(body)) + body)

    def _handle(self, method: bytes, target: bytes, body: bytes) -> None:
        path, _, query = target.partition(b"?")
        state = self.state
        if method == b"POST" and path.endswith(b"/completions"):
            self._generate(query, body)
        elif path == b"/props":
            self._json(
                {
                    "total_slots": state.slots,
                    "default_generation_settings": {"n_ctx": 4096, "params": {}},
                    "model_path": "bench-standin.gguf",
                    "build_info": "bench-standin",
                }
            )
        elif path in (b"/health", b"/v1/health"):
            self._json({"status": "ok"})
        elif path in (b"/v1/models", b"/models"):
            self._json({"object": "list", "data": [{"id": "bench", "object": "model"}]})
        elif path == b"/_bench/config" and method == b"POST":
            state.configure(json.loads(body or b"{}"))
            self._json({"ok": True})
        elif path == b"/_bench/stats":
            state._account()
            self._json(
                {
                    "running": state.running,
                    "started": state.started,
                    "finished": state.finished,
                    "gaps_ns": state.gaps_ns,
                    "busy_ns": state.busy_ns,
                    "peak": state.peak,
                    "slots": state.slots,
                }
            )
        else:
            self._json(
                {"error": {"code": 404, "message": "not found", "type": "not_found_error"}}, 404
            )

    # -- generations ---------------------------------------------------------------------------

    def _generate(self, query: bytes, body: bytes) -> None:
        state = self.state
        state.begin()
        self.busy = True
        if b"hang=1" in query:
            return  # holds its slot until the client leaves
        if _STREAM.search(body):
            assert self.transport is not None
            self.transport.write(_SSE_HEAD)
            self.left = state.tokens
            if state.token_delay_s <= 0:
                # A whole answer at once, after hold_s: what slotgate's STREAM_UPSTREAM turns a
                # non-streamed request into, so both shapes hold the slot equally long.
                if state.hold_s > 0:
                    asyncio.get_running_loop().call_later(state.hold_s, self._burst)
                else:
                    self._burst()
                return
            self.next_token()
            if self.busy:
                state.stream(self)
        elif state.hold_s > 0:
            asyncio.get_running_loop().call_later(state.hold_s, self._complete)
        else:
            self._finish(state.completion)

    def _burst(self) -> None:
        if self.busy and self.transport is not None:
            self._finish(b"".join(_token() for _ in range(self.state.tokens)) + _END)

    def _complete(self) -> None:
        if self.busy:
            self._finish(self.state.completion)

    def next_token(self) -> None:
        if self.transport is None:
            return
        self.left -= 1
        if self.left > 0:
            self.transport.write(_token())
            return
        self.state.streams.discard(self)
        self._finish(_token() + _END)

    def _finish(self, data: bytes) -> None:
        self.busy = False
        self._send(data)
        # Timed after the write: the slot counts as free once its last bytes are on their way.
        self.state.end()
        if self.buffer:
            self._parse()


async def serve(*ports: int) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for port in ports:
        protocol = functools.partial(Connection, State())
        servers.append(
            await loop.create_server(protocol, "127.0.0.1", port, backlog=4096, reuse_address=True)
        )
    print(f"standin listening on {', '.join(map(str, ports))}", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, action="append", required=True)
    args = parser.parse_args()
    run_loop(serve(*args.port))


if __name__ == "__main__":
    main()
