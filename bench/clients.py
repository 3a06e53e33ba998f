"""slotgate's own HTTP client against aiohttp, httpx and httpcore, on slotgate's workload.

    python -m bench.clients [--requests 2000] [--streams 20] [--tokens 64] [--rounds 3]

Each client talks to the stand-in (tests/support/standin.py, another process, on the other core)
over loopback, as slotgate talks to llama-server: one keep-alive connection, a POST of a small
chat completion whose whole JSON answer (about 350 bytes) is read at once, and a streamed
answer read chunk by chunk as it comes (one SSE event every `--token-delay-ms`, each stamped
with the stand-in's clock). The clients run one after the other in the same process, in an
order reversed every round, so that a machine whose speed drifts treats them alike.

Reported per client: CPU time of this process per request and per streamed chunk (the
client's whole cost: parsing, its pool, its task switches, the event loop's wake-ups), the
request's latency (p50, p99: send to last byte), and each chunk's transit from the stand-in's
write to the client's read (p50). CPU figures are the median of the rounds, with the smallest
and largest; latencies pool every round's samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.contenders import configure_standin, start_standin
from bench.loadgen import TOKEN_STAMP
from bench.loop import run_loop
from bench.procs import SERVER_CORE, pin_self
from bench.stats import percentile

PATH = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
ANSWER = json.dumps({"messages": MESSAGES, "stream": False}, separators=(",", ":")).encode()
STREAM = json.dumps({"messages": MESSAGES, "stream": True}, separators=(",", ":")).encode()
OnChunk = Callable[[bytes], None]


class Contender:
    """One HTTP client library, driven the way slotgate drives its upstream client."""

    name = ""

    async def open(self, port: int) -> None:
        raise NotImplementedError

    async def answer(self, body: bytes) -> bytes:
        """POST `body` and return the whole response body."""
        raise NotImplementedError

    async def stream(self, body: bytes, on_chunk: OnChunk) -> None:
        """POST `body` and hand each piece of the response body to `on_chunk` as it arrives."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class Slotgate(Contender):
    name = "slotgate.client"

    async def open(self, port: int) -> None:
        from slotgate.upstreams.reuse import UpstreamClient

        self.client = UpstreamClient(
            "127.0.0.1", port, tls=False, connect_timeout_s=5, keepalive_s=4, stall_s=None
        )
        self.headers = [(b"content-type", b"application/json")]

    async def answer(self, body: bytes) -> bytes:
        response = await self.client.request("POST", PATH, self.headers, body)
        try:
            return await response.read()
        finally:
            response.release()

    async def stream(self, body: bytes, on_chunk: OnChunk) -> None:
        response = await self.client.request("POST", PATH, self.headers, body)
        try:
            while data := await response.readany():
                on_chunk(data)
        finally:
            response.release()

    async def close(self) -> None:
        self.client.close()


class Aiohttp(Contender):
    name = "aiohttp"

    async def open(self, port: int) -> None:
        import aiohttp

        self.url = f"http://127.0.0.1:{port}{PATH}"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4),
            auto_decompress=False,
        )
        self.headers = {"Content-Type": "application/json"}

    async def answer(self, body: bytes) -> bytes:
        async with self.session.post(self.url, data=body, headers=self.headers) as response:
            return await response.read()

    async def stream(self, body: bytes, on_chunk: OnChunk) -> None:
        async with self.session.post(self.url, data=body, headers=self.headers) as response:
            async for data in response.content.iter_any():
                on_chunk(data)

    async def close(self) -> None:
        await self.session.close()


class Httpx(Contender):
    name = "httpx"

    async def open(self, port: int) -> None:
        import httpx

        self.url = f"http://127.0.0.1:{port}{PATH}"
        self.client = httpx.AsyncClient(timeout=30, limits=httpx.Limits(keepalive_expiry=4))
        self.headers = {"Content-Type": "application/json"}

    async def answer(self, body: bytes) -> bytes:
        response = await self.client.post(self.url, content=body, headers=self.headers)
        return response.content

    async def stream(self, body: bytes, on_chunk: OnChunk) -> None:
        request = self.client.build_request("POST", self.url, content=body, headers=self.headers)
        response = await self.client.send(request, stream=True)
        try:
            async for data in response.aiter_raw():
                on_chunk(data)
        finally:
            await response.aclose()

    async def close(self) -> None:
        await self.client.aclose()


class Httpcore(Contender):
    """httpx's transport alone: what httpx costs without its client layer."""

    name = "httpcore"

    async def open(self, port: int) -> None:
        import httpcore

        self.url = f"http://127.0.0.1:{port}{PATH}".encode()
        self.pool = httpcore.AsyncConnectionPool(keepalive_expiry=4)
        self.headers = [
            (b"Host", f"127.0.0.1:{port}".encode()),
            (b"Content-Type", b"application/json"),
        ]

    async def answer(self, body: bytes) -> bytes:
        response = await self.pool.request("POST", self.url, headers=self.headers, content=body)
        return response.content

    async def stream(self, body: bytes, on_chunk: OnChunk) -> None:
        async with self.pool.stream(
            "POST", self.url, headers=self.headers, content=body
        ) as response:
            async for data in response.aiter_stream():
                on_chunk(data)

    async def close(self) -> None:
        await self.pool.aclose()


CONTENDERS: dict[str, type[Contender]] = {c.name: c for c in (Slotgate, Aiohttp, Httpx, Httpcore)}


class Figures:
    """What one client measured, over every round."""

    def __init__(self) -> None:
        self.cpu_per_request_us: list[float] = []
        self.cpu_per_chunk_us: list[float] = []
        self.latency_ns: list[int] = []
        self.transit_ns: list[int] = []
        self.chunks = 0


async def one_round(
    contender: Contender, port: int, figures: Figures, requests: int, streams: int, tokens: int
) -> None:
    await contender.open(port)
    try:
        # Warm up: connections open, code paths and caches hot. slotgate's client holds the
        # connection of its first stream aside for a second (its stream probe) to learn whether
        # the upstream keeps connections after streams; the stand-in does, like most servers.
        for _ in range(100):
            await contender.answer(ANSWER)
        await contender.stream(STREAM, lambda _: None)
        await asyncio.sleep(1.2)
        await contender.stream(STREAM, lambda _: None)

        latency = figures.latency_ns
        clock = time.perf_counter_ns
        cpu = time.process_time()
        for _ in range(requests):
            started = clock()
            answer = await contender.answer(ANSWER)
            latency.append(clock() - started)
        figures.cpu_per_request_us.append((time.process_time() - cpu) / requests * 1e6)
        if not answer.startswith(b'{"id":"chatcmpl-bench"'):
            raise RuntimeError(f"{contender.name} read an unexpected answer: {answer[:80]!r}")

        stamps: list[int] = []
        arrivals: list[int] = []

        def on_chunk(data: bytes) -> None:
            now = time.monotonic_ns()
            for match in TOKEN_STAMP.finditer(data):
                stamps.append(int(match.group(1)))
                arrivals.append(now)

        cpu = time.process_time()
        for _ in range(streams):
            await contender.stream(STREAM, on_chunk)
        spent = time.process_time() - cpu
        if len(stamps) != streams * tokens:
            raise RuntimeError(f"{contender.name} read {len(stamps)} of {streams * tokens} chunks")
        figures.cpu_per_chunk_us.append(spent / len(stamps) * 1e6)
        figures.transit_ns += [a - s for a, s in zip(arrivals, stamps, strict=True)]
        figures.chunks += len(stamps)
    finally:
        await contender.close()


async def measure(
    names: list[str], port: int, rounds: int, requests: int, streams: int, tokens: int
) -> dict[str, Figures]:
    contenders = [CONTENDERS[name]() for name in names]
    figures = {name: Figures() for name in names}
    for index in range(rounds):
        order = contenders if index % 2 == 0 else contenders[::-1]
        for contender in order:
            await one_round(contender, port, figures[contender.name], requests, streams, tokens)
    return figures


def _ms(values: list[int], q: float) -> float:
    value = percentile(values, q)
    assert value is not None
    return value / 1e6


def table(figures: dict[str, Figures]) -> list[dict[str, Any]]:
    rows = []
    for name, measured in figures.items():
        rows.append(
            {
                "client": name,
                "cpu_us_per_request": statistics.median(measured.cpu_per_request_us),
                "cpu_us_per_request_range": [
                    min(measured.cpu_per_request_us),
                    max(measured.cpu_per_request_us),
                ],
                "latency_p50_ms": _ms(measured.latency_ns, 50),
                "latency_p99_ms": _ms(measured.latency_ns, 99),
                "cpu_us_per_chunk": statistics.median(measured.cpu_per_chunk_us),
                "cpu_us_per_chunk_range": [
                    min(measured.cpu_per_chunk_us),
                    max(measured.cpu_per_chunk_us),
                ],
                "chunk_transit_p50_ms": _ms(measured.transit_ns, 50),
                "requests": len(measured.latency_ns),
                "chunks": measured.chunks,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| client | CPU per request (us) | request p50 / p99 (ms) "
        "| CPU per streamed chunk (us) | chunk transit p50 (ms) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        low, high = row["cpu_us_per_request_range"]
        chunk_low, chunk_high = row["cpu_us_per_chunk_range"]
        lines.append(
            f"| {row['client']} | {row['cpu_us_per_request']:.0f} ({low:.0f}-{high:.0f}) "
            f"| {row['latency_p50_ms']:.3f} / {row['latency_p99_ms']:.3f} "
            f"| {row['cpu_us_per_chunk']:.1f} ({chunk_low:.1f}-{chunk_high:.1f}) "
            f"| {row['chunk_transit_p50_ms']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default=",".join(CONTENDERS), help="comma-separated subset")
    parser.add_argument("--requests", type=int, default=2000, help="per client and round")
    parser.add_argument("--streams", type=int, default=20, help="per client and round")
    parser.add_argument("--tokens", type=int, default=64, help="chunks per stream")
    parser.add_argument("--token-delay-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    names = args.clients.split(",")
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown clients {sorted(unknown)}; known: {', '.join(CONTENDERS)}")

    started = time.monotonic()
    logs = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    standin = start_standin(logs)  # on the other core
    try:
        configure_standin(
            standin, tokens=args.tokens, token_delay_s=args.token_delay_ms / 1000, slots=1024
        )
        pin_self(SERVER_CORE)
        figures = run_loop(
            measure(names, standin.port, args.rounds, args.requests, args.streams, args.tokens)
        )
    finally:
        standin.stop()
    rows = table(figures)
    print(markdown(rows))
    print(
        f"\n{args.rounds} rounds of {args.requests} requests and {args.streams} streams of "
        f"{args.tokens} chunks ({args.token_delay_ms:g} ms apart) per client; "
        f"{time.monotonic() - started:.0f} s in all; Python {sys.version.split()[0]}."
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": argv or sys.argv[1:], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
