"""A stand-in llama-server on a raw asyncio protocol: llama-server's routes and answer shapes,
knobs for faults, and counters a test reads (how many generations ran at once, were cut...).

Tests start it in their own loop (`await StandIn().start()`, any number side by side: one
listening socket each, no thread or process). The benchmark runs it on its own core as
`python -m tests.support.standin --port P`, with the knobs in BENCH, configured over
`POST /_bench/config` and read over `GET /_bench/stats`; there every streamed token carries,
as its content, the monotonic clock in nanoseconds at the moment it was written (`stamps`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import select
import time
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import unquote

from tests.support.router import Hosted, Routing

GENERATION_PATHS = frozenset((
    "/v1/chat/completions", "/chat/completions", "/completion", "/completions",
    "/v1/completions", "/infill", "/v1/responses", "/responses", "/v1/messages",
    "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
    "/v1/reranking", "/v1/audio/transcriptions",
))  # fmt: skip

#: The knobs `python -m tests.support.standin` starts with: slots enough never to be the limit, 16
#: tokens at once, stream connections kept open, nothing recorded, tokens stamped.
BENCH: dict[str, Any] = {
    "total_slots": 1024, "tokens": 16, "token_delay_s": 0.0, "close_after_stream": False,
    "record": False, "stamps": True, "created": 1700000000,
}  # fmt: skip

_JSON = b"application/json; charset=utf-8"
_REASONS = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found",
            500: b"Internal Server Error", 503: b"Service Unavailable"}  # fmt: skip
_LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
_TOO_LONG = {"error": {"code": 400, "message": "request (9999 tokens) exceeds the available "
                       "context size (1024 tokens), try increasing it",
                       "type": "exceed_context_size_error"}}  # fmt: skip
_OUT_OF_CACHE = {"error": {"code": 500, "message": "Context size has been exceeded.",
                           "type": "server_error"}}  # fmt: skip
_BAD_KEY = {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
_PLACEHOLDER = "@TOKEN@"  # where the token goes in a content event
#: Body bytes written to a stream in one go before flow control is looked at again.
_BURST_BYTES = 64 * 1024
#: How long stop() waits for closed connections to flush before it drops them.
_FLUSH_S = 0.5
_STREAM = re.compile(rb'"stream"\s*:\s*(true|false)')


class Headers(dict[str, str]):
    """A request's headers, looked up whatever the case (keys are kept in lower case)."""

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


@dataclass
class Seen:
    """One request as the stand-in received it."""

    method: str
    path: str
    query: str
    headers: Headers
    body: bytes


@dataclass(eq=False)
class StandIn:
    """Behaviour knobs (set them from a test, at any time) and counters (read them after)."""

    total_slots: int = 2
    tokens: int = 5
    token_delay_s: float = 0.02
    hold_s: float = 0.0  # before a generation's first token (or its whole answer)
    #: A held stream's head goes with its first token, as llama-server sends it (it waits for
    #: the first result); else at once.
    late_head: bool = False
    loading: bool = False  # answer 503 "Loading model" everywhere, like llama-server does
    # "die_midstream" | "hang" | "garbage" | "error_400" | "out_of_cache"
    fault: str | None = None
    padding: int = 0  # extra bytes of content in every streamed chunk
    close_after_stream: bool = True  # close the connection after a stream, as llama-server does
    api_key: str | None = None  # /props wants it as a Bearer token, as with --api-key
    cors_origins: set[str] | None = None  # None: echo any Origin; else as --cors-origins
    cors_expose: bytes | None = (
        None  # an Access-Control-Expose-Headers of its own (llama-server has none)
    )
    shutdown_timeout_s: float = 60.0  # how long stop() lets running generations finish
    verbose: bool = False  # add `__verbose` to answers, as llama-server --verbose does
    # POST /apply-template and /tokenize answered as llama-server does, one token per word,
    # after count_delay_s, or with count_answer (raw bytes) instead; else they are echoed.
    counts: bool = False
    count_delay_s: float = 0.0
    count_answer: bytes | None = None
    record: bool = True  # keep every request in `seen`
    stamps: bool = False  # a streamed token's content is the monotonic clock in ns
    record_gaps: bool = False  # how long each freed slot stays empty, in gaps_ns
    sent_bytes: int = 0  # streamed bytes handed to the socket so far
    tokens_predicted: tuple[int, float] = (0, 0.0)  # /metrics: tokens generated, seconds taken
    running: int = 0
    max_running: int = 0
    started: int = 0
    finished: int = 0
    cancelled: int = 0  # generations whose client left (or that were cut) before their end
    counted: int = 0  # /apply-template requests answered
    seen: list[Seen] = field(default_factory=list)
    gaps_ns: list[int] = field(default_factory=list)
    port: int = 0
    model: str = "standin.gguf"  # /props model_path, /v1/models id
    aliases: list[str] = field(default_factory=list)  # /v1/models aliases (--alias)
    host: str = "127.0.0.1"  # any of 127.0.0.0/8: several stand-ins on one port, for DNS
    created: int = field(default_factory=lambda: int(time.time()))
    # Router mode (tests/support/router.py): the models by id, each with a child of its own.
    hosted: dict[str, Hosted] | None = None
    models_max: int = 4  # --models-max
    models_autoload: bool = True  # --models-autoload (--no-models-autoload: False)
    load_delay_s: float = 0.02  # how long a child takes to load

    def __post_init__(self) -> None:
        #: Its models and scheduler, as a router; None for a server of one model.
        self.routing = Routing(self, self.hosted) if self.hosted is not None else None
        self._server: asyncio.Server | None = None
        self._listening = False
        self._connections: set[Connection] = set()
        self._streams: set[Connection] = set()
        self._ticking = False
        self._free_since: collections.deque[int] = collections.deque()
        self._answers: dict[tuple[Any, ...], bytes] = {}
        self.busy_ns = 0  # generation-nanoseconds: running integrated over time
        self._changed_ns = time.monotonic_ns()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on `host` at `port` (0: any free one, kept for a restart)."""
        loop = asyncio.get_running_loop()
        self._listening = True
        self._server = await loop.create_server(
            lambda: Connection(self), self.host, self.port, backlog=4096, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop as llama-server does on SIGTERM: stop listening, close idle connections, let
        running generations finish for up to shutdown_timeout_s, then cut the rest."""
        server, self._server = self._server, None
        if server is None:
            return
        self._listening = False
        # asyncio (3.11) refuses a transport to a connection it accepted just before close(),
        # and leaves that socket open, unread, until the garbage collector finds it (a request
        # sent down it waits forever). So stop accepting, let the accepted ones get their
        # transports (connection_made drops them), and only then close.
        loop = asyncio.get_running_loop()
        for sock in server.sockets:
            loop.remove_reader(sock.fileno())
        for _ in range(4):
            await asyncio.sleep(0)
        server.close()
        for conn in list(self._connections):
            conn.shut()
        try:
            async with asyncio.timeout(self.shutdown_timeout_s):
                while any(conn.busy for conn in self._connections):
                    await asyncio.sleep(0.005)
        except TimeoutError:
            for conn in list(self._connections):
                conn.cut()
        try:
            async with asyncio.timeout(_FLUSH_S):
                while self._connections:
                    await asyncio.sleep(0.005)
        except TimeoutError:
            for conn in list(self._connections):
                conn.drop()

    def hurry(self) -> None:
        """Let running and later generations finish at once: for a test that has seen what it
        held a slot for (a running stream reads the delay before each token; a non-streamed
        answer waits on one timer for all of its tokens, which this cuts short)."""
        self.token_delay_s = 0.0
        for conn in list(self._streams):
            conn.pump()
        for conn in list(self._connections):
            conn.answer_now()

    def connections(self) -> int:
        """Connections open at the stand-in right now."""
        return len(self._connections)

    # -- the benchmark's control routes ---------------------------------------------------------

    def configure(self, values: dict[str, Any]) -> None:
        """Set knobs by name (`slots` is total_slots) and start the counts afresh."""
        for name, value in values.items():
            name = "total_slots" if name == "slots" else name
            if name not in _KNOBS:
                raise ValueError(f"no knob {name!r}")
            setattr(self, name, value)
        self.tokens = max(1, self.tokens)
        self._free_since.clear()
        self.gaps_ns = []
        self.started = self.finished = 0
        self.busy_ns = 0
        self.max_running = self.running
        self._changed_ns = time.monotonic_ns()

    def stats(self) -> dict[str, Any]:
        self._account()
        return {"running": self.running, "started": self.started, "finished": self.finished,
                "cancelled": self.cancelled, "gaps_ns": self.gaps_ns, "busy_ns": self.busy_ns,
                "peak": self.max_running, "slots": self.total_slots}  # fmt: skip

    def _account(self) -> None:
        """Generation-seconds so far: `running` integrated over time (the fleet's balance)."""
        now = time.monotonic_ns()
        self.busy_ns += self.running * (now - self._changed_ns)
        self._changed_ns = now

    # -- generations ----------------------------------------------------------------------------

    def begin(self) -> None:
        if self.running >= self.total_slots:
            self._reap()
        self._account()
        self.running += 1
        self.started += 1
        if self.running > self.max_running:
            self.max_running = self.running
        if self.record_gaps and self._free_since:
            # The oldest freed slot is the one this arrival fills: FIFO matches llama-server,
            # which hands a free slot to the next task in its own order.
            self.gaps_ns.append(time.monotonic_ns() - self._free_since.popleft())

    def end(self, cancelled: bool = False) -> None:
        self._account()
        self.running -= 1
        self.finished += 1
        if cancelled:
            self.cancelled += 1
        if self.record_gaps:
            self._free_since.append(time.monotonic_ns())

    def _reap(self) -> None:
        """End the generations whose client has closed its connection, though the loop has
        not read that yet: a slot its client gave up goes straight to the next request, which
        the loop may read first (llama-server's slot count is what tests check slotgate by)."""
        poller = select.poll()
        busy: dict[int, Connection] = {}
        for conn in self._connections:
            if conn.busy and conn.transport is not None:
                fd = conn.transport.get_extra_info("socket").fileno()
                poller.register(fd, select.POLLRDHUP)
                busy[fd] = conn
        for fd, _ in poller.poll(0):
            busy[fd].lost()

    def stream(self, conn: Connection) -> None:
        self._streams.add(conn)
        if not self._ticking:
            self._ticking = True
            loop = asyncio.get_running_loop()
            loop.call_at(loop.time() + self.token_delay_s, self._tick, loop.time())

    def unstream(self, conn: Connection) -> None:
        self._streams.discard(conn)

    def _tick(self, scheduled: float) -> None:
        # One timer drives every stream, like one llama.cpp decode step yields one token for
        # every busy slot: it keeps the stand-in's own cost per token to a write.
        for conn in list(self._streams):
            conn.pump()
        if not self._streams:
            self._ticking = False
            return
        loop = asyncio.get_running_loop()
        due = scheduled + self.token_delay_s
        now = loop.time()
        if due < now:  # fell behind: skip the missed ticks rather than burst to catch up
            due = now + self.token_delay_s
        loop.call_at(due, self._tick, due)

    # -- canned answers ------------------------------------------------------------------------

    def answer(self, kind: str) -> bytes:
        """The bytes of an answer that depends only on the knobs, built once per setting."""
        key = (kind, self.tokens, self.verbose, self.created)
        cached = self._answers.get(key)
        if cached is None:
            if len(self._answers) > 64:
                self._answers.clear()
            cached = self._answers[key] = _ANSWERS[kind](self)
        return cached

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": 3, "completion_tokens": self.tokens,
                "total_tokens": 3 + self.tokens}  # fmt: skip

    def _completion(self) -> bytes:
        body = json.dumps(
            {
                "choices": [{"finish_reason": "stop", "index": 0, "message": {
                    "role": "assistant", "content": "".join(f"t{i} " for i in range(self.tokens)),
                }}],
                "created": self.created,
                "model": "standin.gguf",
                "system_fingerprint": "b0-standin",
                "object": "chat.completion",
                "usage": self.usage(),
                "id": "chatcmpl-standin",
                "timings": {"predicted_n": self.tokens},
                **({"__verbose": {"stream": False}} if self.verbose else {}),
            }
        ).encode()  # fmt: skip
        return head(200, _JSON, len(body)) + body

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {"choices": choices, "created": self.created, "id": "chatcmpl-standin",
                 "model": "standin.gguf", "system_fingerprint": "b0-standin",
                 "object": "chat.completion.chunk", **extra}  # fmt: skip
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def _token_parts(self) -> bytes:
        """A content event with the placeholder where the token goes."""
        return self._event([{"finish_reason": None, "index": 0,
                             "delta": {"content": _PLACEHOLDER}}])  # fmt: skip

    def _role(self) -> bytes:
        return self._event([{"finish_reason": None, "index": 0,
                             "delta": {"role": "assistant", "content": None}}])  # fmt: skip

    def _finish(self) -> bytes:
        extra: dict[str, Any] = {"__verbose": {"stream": True}} if self.verbose else {}
        return self._event([{"finish_reason": "stop", "index": 0, "delta": {}}],
                           timings={"predicted_n": self.tokens}, **extra)  # fmt: skip

    def _usage_event(self) -> bytes:
        return self._event([], usage=self.usage())


_KNOBS = frozenset(
    ("total_slots", "tokens", "token_delay_s", "hold_s", "loading", "fault", "padding",
     "close_after_stream", "verbose", "record", "stamps", "record_gaps")
)  # fmt: skip
_ANSWERS = {
    "completion": StandIn._completion,
    "token": StandIn._token_parts,
    "role": StandIn._role,
    "finish": StandIn._finish,
    "usage": StandIn._usage_event,
}


def head(status: int, content_type: bytes, length: int, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
        status, _REASONS.get(status, b"OK"), content_type, length, extra,
    )  # fmt: skip


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"X-Accel-Buffering: no\r\nTransfer-Encoding: chunked\r\n"
)
_END = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _value(head_lower: bytes, raw: bytes, name: bytes) -> bytes | None:
    """A header's value from a request head (found in its lower-cased copy)."""
    at = head_lower.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    stop = head_lower.find(b"\r\n", start)
    return raw[start : stop if stop >= 0 else None].strip()


class Connection(asyncio.Protocol):
    """One client connection; its requests are answered one at a time, in order."""

    def __init__(self, standin: StandIn) -> None:
        #: The stand-in that serves the running request: the one listening, or a router's child.
        self.standin = standin
        self.home = standin
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a generation runs on this connection
        self.held = False  # an answer other than a generation is due later
        self.head_only = False  # the running request is a HEAD
        self.keep_alive = True
        self.closing = False  # the stand-in stops: close once the running answer is out
        self.paused = False  # the socket's buffer is full (flow control)
        self.timer: asyncio.TimerHandle | None = None
        self.left = 0  # tokens still to send on the running stream
        self.index = 0  # the next token's number
        self.usage = False  # the running stream ends with a usage event
        self.streaming = False
        self.cors = b""  # the running request's CORS headers

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, though they implement it.
        self.transport = cast(asyncio.Transport, transport)
        if not self.home._listening:  # accepted as the stand-in stopped
            self.transport.abort()
            return
        self.home._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.home._connections.discard(self)
        if self.busy:
            # A client that leaves frees its slot, as llama-server cancels the task.
            self._release()
            self.standin.end(cancelled=True)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy and not self.held:
            self._parse()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.streaming and self.standin.token_delay_s <= 0:
            self.pump()

    # -- the stand-in's hooks -------------------------------------------------------------------

    def shut(self) -> None:
        self.closing = True
        if not self.busy and not self.held and self.transport is not None:
            self.transport.close()

    def cut(self) -> None:
        if self.busy and self.transport is not None:
            self._release()
            self.standin.end(cancelled=True)
            self.transport.close()

    def lost(self) -> None:
        """Its client is gone (seen before the loop saw it): end its generation now."""
        if self.busy and self.transport is not None:
            self._release()
            self.standin.end(cancelled=True)
            self.transport.abort()

    def drop(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- requests -------------------------------------------------------------------------------

    def _parse(self) -> None:
        buffer = self.buffer
        while not self.busy and not self.held and self.transport is not None and not self.closing:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            raw = bytes(buffer[:end])
            lower = raw.lower()
            length = 0
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = lower.find(b"\r\n", at + 2)
                length = int(lower[at + 17 : stop if stop >= 0 else None])
            total = end + 4 + length
            if len(buffer) < total:
                return
            body = bytes(buffer[end + 4 : total])
            del buffer[:total]
            method, _, rest = raw.partition(b"\r\n")[0].partition(b" ")
            target = rest.partition(b" ")[0] or b"/"
            self.keep_alive = b"\r\nconnection: close" not in lower
            self._handle(method.decode("latin-1"), target, lower, raw, body)

    def _handle(self, method: str, target: bytes, lower: bytes, raw: bytes, body: bytes) -> None:
        self.standin = self.home
        path_bytes, _, query = target.partition(b"?")
        path = path_bytes.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        self.cors = self._cors(method, lower, raw) if b"\r\norigin:" in lower else b""
        self.head_only = method == "HEAD"
        routing = self.home.routing
        if routing is not None and routing.handle(
            self, method, path, query, lower, raw, body, target
        ):
            return
        standin = self.standin
        if method == "POST" and path in GENERATION_PATHS:
            if standin.fault == "out_of_cache":  # what a unified cache answers when it runs out
                self._json(_OUT_OF_CACHE, 500)
                return
            if standin.record:
                self._record(method, path, query, raw, body)
            self._generate(query, body)
        elif path == "/props":
            self._props(lower, raw)
        elif path == "/health":
            self._json(_LOADING, 503) if standin.loading else self._json({"status": "ok"})
        elif path == "/v1/models" and method == "GET":
            model = {"id": standin.model, "aliases": standin.aliases, "object": "model"}
            self._json({"data": [model], "object": "list"})
        elif path == "/metrics":
            self._metrics()
        elif method == "POST" and path == "/_bench/config":
            try:
                standin.configure(json.loads(body or b"{}"))
            except (ValueError, TypeError) as exc:
                self._json({"error": {"code": 400, "message": str(exc)}}, 400)
            else:
                self._json({"ok": True})
        elif path == "/_bench/stats":
            self._json(standin.stats())
        elif method == "POST" and standin.counts and path in ("/apply-template", "/tokenize"):
            self._count(path, body)
        else:
            if standin.record:
                self._record(method, path, query, raw, body)
            self._echo(method, path, query, body)

    def _record(self, method: str, path: str, query: bytes, raw: bytes, body: bytes) -> None:
        headers = Headers()
        for line in raw.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
        self.standin.seen.append(Seen(method, path, query.decode("latin-1"), headers, body))

    def _cors(self, method: str, lower: bytes, raw: bytes) -> bytes:
        """As llama-server does: every answer echoes the Origin (only an allowed one, when
        started with --cors-origins); a preflight allows the rest."""
        origin = _value(lower, raw, b"origin")
        if origin is None:
            return b""
        allowed = self.standin.cors_origins
        if allowed is not None and origin.decode("latin-1") not in allowed:
            origin = ",".join(sorted(allowed)).encode("latin-1")
        out = b"Access-Control-Allow-Origin: %s\r\n" % origin
        if self.standin.cors_expose is not None:
            out += b"Access-Control-Expose-Headers: %s\r\n" % self.standin.cors_expose
        if method == "OPTIONS":
            out += (
                b"Access-Control-Allow-Credentials: true\r\n"
                b"Access-Control-Allow-Methods: GET, POST, DELETE, OPTIONS\r\n"
                b"Access-Control-Allow-Headers: *\r\n"
            )
        return out

    def _send(self, data: bytes) -> None:
        if self.transport is None:
            return
        if self.head_only:
            data = data[: data.index(b"\r\n\r\n") + 4]
        self.transport.write(data)
        if not self.keep_alive or self.closing:
            self.transport.close()

    def _json(self, value: Any, status: int = 200, extra: bytes = b"") -> None:
        body = json.dumps(value).encode()
        self._send(head(status, _JSON, len(body), extra + self.cors) + body)

    def _props(self, lower: bytes, raw: bytes) -> None:
        standin = self.standin
        if standin.loading:
            self._json(_LOADING, 503)
        elif standin.api_key is not None and _value(lower, raw, b"authorization") != (
            b"Bearer " + standin.api_key.encode()
        ):
            self._json(_BAD_KEY, 401)
        else:
            self._json({
                "total_slots": standin.total_slots,
                "default_generation_settings": {"n_ctx": 1024, "params": {}},
                "model_path": standin.model,
                "build_info": "standin",
            })  # fmt: skip

    def _metrics(self) -> None:
        standin = self.standin
        tokens, seconds = standin.tokens_predicted
        text = (
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {standin.running}\n"
            "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed\n"
            "# TYPE llamacpp:tokens_predicted_total counter\n"
            f"llamacpp:tokens_predicted_total {tokens}\n"
            "# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens\n"
            "# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
            f"llamacpp:tokens_predicted_seconds_total {seconds}\n"
        ).encode()
        # llama-server sends when it started with its metrics.
        extra = b"Process-Start-Time-Unix: %d\r\n" % standin.created + self.cors
        self._send(head(200, b"text/plain; charset=utf-8", len(text), extra) + text)

    def _echo(self, method: str, path: str, query: bytes, body: bytes) -> None:
        answer = {"method": method, "path": path, "query": query.decode("latin-1"),
                  "body": body.decode("utf-8", "replace")}  # fmt: skip
        self._json(answer, extra=b"X-Standin: echo\r\n")

    def _count(self, path: str, body: bytes) -> None:
        standin = self.standin
        if path == "/apply-template":
            standin.counted += 1
        self.held = True  # answered later: later requests on this connection wait for it

        def answer() -> None:
            if self.transport is None:
                return
            self.held = False
            if standin.count_answer is not None:
                data = standin.count_answer
                self._send(head(200, _JSON, len(data), self.cors) + data)
            else:
                payload = json.loads(body)
                if path == "/apply-template":
                    text = " ".join(m["content"] for m in payload["messages"])
                    self._json({"prompt": text})
                else:
                    self._json({"tokens": [1] * len(payload["content"].split())})
            if self.buffer:
                self._parse()

        if standin.count_delay_s:
            asyncio.get_running_loop().call_later(standin.count_delay_s, answer)
        else:
            answer()

    # -- generations ----------------------------------------------------------------------------

    def _generate(self, query: bytes, body: bytes) -> None:
        standin = self.standin
        fault = standin.fault
        if standin.loading:
            self._json(_LOADING, 503)
            return
        if fault == "error_400":
            self._json(_TOO_LONG, 400)
            return
        standin.begin()
        self.busy = True
        found = _STREAM.search(body)  # the usual body, read without parsing it
        streamed = found[1] == b"true" if found is not None else _streamed(body)
        if b"hang=1" in query or (fault == "hang" and not streamed):
            return  # holds its slot until the client leaves
        delay = standin.hold_s
        if streamed:
            self.streaming = True
            self.left = standin.tokens
            self.index = 0
            self.usage = _wants_usage(body)
            head = _SSE_HEAD + self.cors + b"\r\n"
            if delay > 0:
                assert self.transport is not None  # busy only while connected
                if standin.late_head:
                    self.timer = asyncio.get_running_loop().call_later(delay, self._first, head)
                    return
                self.transport.write(head)
                self.timer = asyncio.get_running_loop().call_later(delay, self._first)
            else:
                self._first(head)
            return
        delay += standin.tokens * standin.token_delay_s
        if delay > 0:
            self.timer = asyncio.get_running_loop().call_later(delay, self._complete)
        elif fault is None and not self.cors:
            self._end(standin.answer("completion"))
        else:
            self._complete()

    def answer_now(self) -> None:
        """A non-streamed answer waiting out its tokens' time goes at once, and a stream whose
        head waits for its first token (`late_head`) begins."""
        if self.timer is not None and self.busy and not self.streaming:
            self.timer.cancel()
            self.timer = None
            self._complete()
        elif self.timer is not None and self.busy and self.standin.late_head:
            self.timer.cancel()
            self._first(_SSE_HEAD + self.cors + b"\r\n")

    def _complete(self) -> None:
        standin = self.standin
        if standin.fault == "garbage":
            self._end(head(200, _JSON, 10, self.cors) + b"\x00\xffnot json")
        elif self.cors:
            data = standin.answer("completion")
            at = data.index(b"\r\n\r\n") + 2
            self._end(data[:at] + self.cors + data[at:])
        else:
            self._end(standin.answer("completion"))

    def _first(self, head: bytes = b"") -> None:
        """The first token goes at once (with the role event before it); the rest follow at
        the stand-in's token clock, or all at once when it has no delay."""
        self.timer = None
        if self.transport is None:
            return
        self.pump(head + _chunk(self.standin.answer("role")))
        if self.busy and self.standin.token_delay_s > 0:
            self.standin.stream(self)

    def pump(self, lead: bytes = b"") -> None:
        """Write the next token, or as many as the socket takes when there is no delay."""
        standin = self.standin
        transport = self.transport
        if transport is None or not self.busy or self.paused or self.timer is not None:
            return
        burst = standin.token_delay_s <= 0
        if burst:
            standin.unstream(self)  # resume_writing carries it on, not the clock
        parts = [lead]
        size = 0
        prefix, _, suffix = standin.answer("token").partition(_PLACEHOLDER.encode())
        fault, stamps, padding = standin.fault, standin.stamps, b"x" * standin.padding
        while self.left > 0:
            if fault is None:
                pass
            elif fault == "die_midstream" and self.index == 2:
                self._write(transport, parts)
                standin.unstream(self)
                transport.abort()  # connection_lost counts it as cut short
                return
            elif fault == "hang" and self.index == 1:
                self._write(transport, parts)
                standin.unstream(self)
                return  # holds its slot until the client leaves
            content = b"%d " % time.monotonic_ns() if stamps else b"t%d " % self.index + padding
            event = _chunk(prefix + content + suffix)
            parts.append(event)
            self.index += 1
            self.left -= 1
            if not burst:
                break
            size += len(event)
            if size >= _BURST_BYTES and self.left:
                self._write(transport, parts)
                parts, size = [], 0
                if self.paused:
                    return  # resume_writing goes on
        if self.left > 0:
            self._write(transport, parts)
            return
        parts.append(_chunk(standin.answer("finish")))
        if self.usage:
            parts.append(_chunk(standin.answer("usage")))
        parts.append(_END)
        if standin.close_after_stream:
            self.keep_alive = False  # though the head said nothing of it
        self.standin.sent_bytes += sum(map(len, parts))
        self._end(b"".join(parts))

    def _write(self, transport: asyncio.Transport, parts: list[bytes]) -> None:
        data = b"".join(parts)
        transport.write(data)
        self.standin.sent_bytes += len(data)

    def _end(self, data: bytes) -> None:
        """The generation's last bytes: its slot counts as free once they are on their way."""
        self._release()
        self._send(data)
        self.standin.end()
        if self.buffer and self.transport is not None:
            self._parse()

    def _release(self) -> None:
        self.busy = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.streaming:
            self.streaming = False
            self.standin.unstream(self)


def _streamed(body: bytes) -> bool:
    return body[:1] == b"{" and bool(_payload(body).get("stream"))


def _wants_usage(body: bytes) -> bool:
    if b"include_usage" not in body:
        return False
    # Like llama-server, a malformed option falls back to its default.
    options = _payload(body).get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _payload(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def serve(ports: list[int], knobs: dict[str, Any]) -> None:
    """One stand-in per port, each with its own slots, knobs and counters (a cheap fleet)."""
    for port in ports:
        await StandIn(port=port, **{**BENCH, **knobs}).start()
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--port", type=int, action="append", required=True, help="again for more stand-ins"
    )
    parser.add_argument("--knobs", default="{}", help="StandIn knobs as JSON, over BENCH")
    args = parser.parse_args()
    from bench.loop import run_loop  # the bench's own loop (uvloop), only when run alone

    run_loop(serve(args.port, json.loads(args.knobs)))


if __name__ == "__main__":
    main()
