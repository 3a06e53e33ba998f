"""Load generators: wrk for plain POST throughput, and a raw asyncio client for the rest.

The raw client is one `asyncio.Protocol` per connection with httptools parsing the answers
and callbacks instead of tasks, so that the load generator's own cost per request stays a few
microseconds and the core it shares with the stand-in is not the bottleneck.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.client
import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httptools

Done = Callable[["Exchange", int], None]
#: The status a request gets when its connection closed before any answer arrived.
RESEND = -2

#: A streamed token's content is the stand-in's monotonic clock (ns) at the moment it wrote it.
#: LiteLLM re-encodes chunks, so the pattern allows an optional space after the colon.
TOKEN_STAMP = re.compile(rb'"content": ?"(\d{6,}) ')


def request_bytes(port: int, path: str, body: dict[str, Any] | None, method: str = "POST") -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    return head.encode() + b"\r\n" + payload


def chat_body(stream: bool, max_tokens: int = 16) -> dict[str, Any]:
    return {
        "model": "bench",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@dataclass
class StreamStats:
    """What streamed answers looked like at the client, within the measuring window."""

    window: tuple[int, int]
    #: What marks one token in the stream; with a group, the group is the stand-in's stamp.
    pattern: re.Pattern[bytes] = TOKEN_STAMP
    transit_ns: list[int] = field(default_factory=list)  # stand-in write -> client read
    gaps_ns: list[int] = field(default_factory=list)  # between a stream's successive tokens
    ttfb_ns: list[int] = field(default_factory=list)  # request sent -> first body byte
    ttft_ns: list[int] = field(default_factory=list)  # request sent -> first token
    tokens: int = 0


class StreamProbe:
    """Reads one connection's streamed answers for the stamps the stand-in put in them."""

    __slots__ = ("buffer", "first_byte", "last", "scan", "sent", "stats")

    def __init__(self, stats: StreamStats) -> None:
        self.stats = stats
        self.buffer = bytearray()
        self.scan = 0
        self.sent = 0
        self.first_byte = 0
        self.last = 0

    def begin(self, sent_ns: int) -> None:
        self.buffer.clear()
        self.scan = 0
        self.sent = sent_ns
        self.first_byte = 0
        self.last = 0

    def feed(self, now: int, body: bytes) -> None:
        stats = self.stats
        start, end = stats.window
        inside = start <= now <= end
        if not self.first_byte:
            self.first_byte = now
            if inside:
                stats.ttfb_ns.append(now - self.sent)
        self.buffer += body
        stamped = stats.pattern.groups > 0
        for match in stats.pattern.finditer(self.buffer, self.scan):
            self.scan = match.end()
            if inside:
                stats.tokens += 1
                if stamped:
                    stats.transit_ns.append(now - int(match.group(1)))
                if self.last:
                    stats.gaps_ns.append(now - self.last)
                else:
                    stats.ttft_ns.append(now - self.sent)
            self.last = now


class Exchange(asyncio.Protocol):
    """One keep-alive HTTP/1.1 client connection; one request in flight at a time."""

    def __init__(self, probe: StreamProbe | None = None) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.probe = probe
        self.closed = False
        self.status = 0
        self.sent_ns = 0
        self.now_ns = 0
        self.body = bytearray()
        self.keep_body = False
        self.answered = False  # some of the answer to the request in flight has arrived
        self._done: Done | None = None

    def send(self, raw: bytes, done: Done | None) -> None:
        self.sent_ns = time.monotonic_ns()
        self._done = done
        self.answered = False
        self.body.clear()
        if self.probe is not None:
            self.probe.begin(self.sent_ns)
        assert self.transport is not None
        self.transport.write(raw)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, though they implement it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.now_ns = time.monotonic_ns()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        done, self._done = self._done, None
        if done is not None:
            # Closed before any answer: the server had dropped an idle keep-alive connection
            # (llama-server does after a stream), so the request was never taken: resend it.
            done(self, -1 if self.answered else RESEND)

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.answered = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.probe is not None:
            self.probe.feed(self.now_ns, body)
        if self.keep_body:
            self.body += body

    def on_message_complete(self) -> None:
        if not self.parser.should_keep_alive():
            self.closed = True
        done, self._done = self._done, None
        if done is not None:
            done(self, self.status)


async def connect(
    port: int, count: int, probe: Callable[[], StreamProbe | None] = lambda: None
) -> list[Exchange]:
    """Open `count` connections, a few hundred at a time so the listen backlog never overflows."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(200)

    async def one() -> Exchange:
        async with gate:
            _, protocol = await loop.create_connection(lambda: Exchange(probe()), "127.0.0.1", port)
            return protocol

    return list(await asyncio.gather(*(one() for _ in range(count))))


@dataclass
class LoopResult:
    """Requests that completed inside the measuring window."""

    duration_s: float
    latencies_ns: list[int]
    statuses: collections.Counter[int]
    errors: int
    stream: StreamStats | None = None
    resent: int = 0

    @property
    def completed(self) -> int:
        return len(self.latencies_ns)

    @property
    def rate(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0


class _Driver:
    """Shared bookkeeping for closed- and open-loop runs: a window, latencies and statuses."""

    def __init__(self, port: int, raw: bytes, start_ns: int, end_ns: int) -> None:
        self.port = port
        self.raw = raw
        self.start_ns = start_ns
        self.end_ns = end_ns
        self.latencies: list[int] = []
        self.statuses: collections.Counter[int] = collections.Counter()
        self.errors = 0
        self.resent = 0
        self.outstanding = 0
        self.idle = asyncio.Event()
        #: A request of its own for some connections (`closed_loop(bodies=...)`).
        self.assigned: dict[Exchange, bytes] = {}

    def record(self, exchange: Exchange, status: int) -> int:
        now = time.monotonic_ns()
        self.outstanding -= 1
        if status == RESEND:
            self.resent += 1
        elif status < 0:
            self.errors += 1
        elif self.start_ns <= now <= self.end_ns:
            self.latencies.append(now - exchange.sent_ns)
            self.statuses[status] += 1
        if self.outstanding == 0:
            self.idle.set()
        return now

    def fire(self, exchange: Exchange, done: Done) -> None:
        self.outstanding += 1
        self.idle.clear()
        exchange.send(self.assigned.get(exchange, self.raw), done)

    async def drain(self, timeout_s: float) -> None:
        if self.outstanding:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.idle.wait()


async def closed_loop(
    port: int,
    raw: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.0,
    streaming: bool = False,
    drain_s: float = 30.0,
    pattern: re.Pattern[bytes] = TOKEN_STAMP,
    bodies: Sequence[bytes] = (),
) -> LoopResult:
    """`concurrency` clients, each sending its next request the moment its answer ends;
    client i sends `bodies[i % len(bodies)]` when bodies are given, else `raw`."""
    now = time.monotonic_ns()
    start = now + int(warmup_s * 1e9)
    end = start + int(duration_s * 1e9)
    stats = StreamStats((start, end), pattern) if streaming else None
    driver = _Driver(port, raw, start, end)
    exchanges = await connect(port, concurrency, lambda: StreamProbe(stats) if stats else None)
    pending: set[asyncio.Task[None]] = set()
    for index, exchange in enumerate(exchanges if bodies else ()):
        driver.assigned[exchange] = bodies[index % len(bodies)]

    async def reconnect(raw: bytes) -> None:
        with contextlib.suppress(OSError):
            [fresh] = await connect(port, 1, lambda: StreamProbe(stats) if stats else None)
            exchanges.append(fresh)
            driver.assigned[fresh] = raw
            driver.fire(fresh, done)

    def done(exchange: Exchange, status: int) -> None:
        now = driver.record(exchange, status)
        if now >= end:
            return
        if exchange.closed:
            exchange.close()
            task = asyncio.ensure_future(reconnect(driver.assigned.pop(exchange, raw)))
            pending.add(task)
            task.add_done_callback(pending.discard)
        else:
            driver.fire(exchange, done)

    try:
        for exchange in exchanges:
            driver.fire(exchange, done)
        await asyncio.sleep(max(0.0, (end - time.monotonic_ns()) / 1e9))
        await driver.drain(drain_s)
    finally:
        for exchange in exchanges:
            exchange.close()
    return LoopResult(
        duration_s, driver.latencies, driver.statuses, driver.errors, stats, driver.resent
    )


async def open_loop(
    port: int,
    raw: bytes,
    connections: int,
    rate_per_s: float,
    duration_s: float,
    bodies: Sequence[bytes] = (),
) -> tuple[LoopResult, int]:
    """Requests at a fixed rate spread over idle connections; also how many found none idle.
    Connection i sends `bodies[i % len(bodies)]` when bodies are given, else `raw`."""
    exchanges = await connect(port, connections)
    idle = collections.deque(exchanges)
    start = time.monotonic_ns()
    end = start + int(duration_s * 1e9)
    driver = _Driver(port, raw, start, end)
    for index, exchange in enumerate(exchanges if bodies else ()):
        driver.assigned[exchange] = bodies[index % len(bodies)]
    starved = 0

    def done(exchange: Exchange, status: int) -> None:
        driver.record(exchange, status)
        if not exchange.closed:
            idle.append(exchange)

    sent = 0
    try:
        while (now := time.monotonic_ns()) < end:
            due = int((now - start) / 1e9 * rate_per_s) - sent
            for _ in range(due):
                sent += 1
                if not idle:
                    starved += 1
                    continue
                driver.fire(idle.popleft(), done)
            await asyncio.sleep(0.0005)
        await driver.drain(10.0)
    finally:
        for exchange in exchanges:
            exchange.close()
    result = LoopResult(duration_s, driver.latencies, driver.statuses, driver.errors)
    return result, starved


async def fetch(exchange: Exchange, raw: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """One request on an open connection, its status and body."""
    future: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def done(_: Exchange, status: int) -> None:
        if not future.done():
            future.set_result(status)

    exchange.keep_body = True
    exchange.send(raw, done)
    async with asyncio.timeout(timeout_s):
        status = await future
    return status, bytes(exchange.body)


# -- plain synchronous calls, for control routes --


def http_json(
    port: int, path: str, body: Any = None, method: str | None = None, timeout_s: float = 5.0
) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        connection.request(method or ("POST" if payload else "GET"), path, payload, headers)
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode("utf-8", "replace")


def wait_http(port: int, path: str, timeout_s: float, ok: Callable[[int], bool]) -> None:
    """Poll until `path` answers a status `ok` accepts; raise TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            status, _ = http_json(port, path, timeout_s=2.0)
        except (OSError, http.client.HTTPException) as exc:
            last = exc
        else:
            if ok(status):
                return
            last = status
        time.sleep(0.1)
    raise TimeoutError(f"127.0.0.1:{port}{path} not ready after {timeout_s:.0f} s (last: {last})")


# -- wrk --

_WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [==[%s]==]
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCHJSON {\\"requests\\":%%d,\\"duration_us\\":%%d,\\"connect\\":%%d,\\"read\\":%%d," ..
    "\\"write\\":%%d,\\"status\\":%%d,\\"timeout\\":%%d,\\"p50_us\\":%%d,\\"p99_us\\":%%d," ..
    "\\"mean_us\\":%%.1f,\\"max_us\\":%%d}\\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean, latency.max))
end
"""


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def wrk(
    port: int, path: str, body: dict[str, Any], concurrency: int, duration_s: float
) -> dict[str, Any]:
    """One wrk run (one thread, on the load generator's core); its counts and percentiles."""
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(_WRK_SCRIPT % json.dumps(body, separators=(",", ":")))
        command = [
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(duration_s))}s",
            "--timeout",
            "30s",
            "-s",
            str(script),
            f"http://127.0.0.1:{port}{path}",
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=duration_s + 60, check=False
        )
    for line in done.stdout.splitlines():
        if line.startswith("BENCHJSON "):
            result: dict[str, Any] = json.loads(line.removeprefix("BENCHJSON "))
            return result
    raise RuntimeError(f"wrk printed no result: {done.stdout[-500:]} {done.stderr[-500:]}")
