"""Slow-loris heads against HEAD_TIMEOUT_S, and what bounding heads costs ordinary requests.

    python -m bench.experiments.slow_heads loris [--connections 2200] [--head-timeout-s 2]
    python -m bench.experiments.slow_heads cost [--big 10] [--small 2000]
    (either with [--pythonpath DIR] to run another slotgate)

Issue 13, point 12: heads trickled a byte at a time were bounded in size but not in time
(2,200 such connections stayed open for 60 s). slotgate runs in this process under uvicorn
as `slotgate` configures it, in front of tests/support/standin.py in a process of its own.
- `loris` opens `--connections` connections that each send the start of a head and then one
  byte every half second. It prints how long opening them took, when the last was closed by
  slotgate (or how many were still open at `--timeout-s`), how many were answered 408, a
  `/healthz` request's time meanwhile, and, when slotgate has a periodic head sweep
  (`slotgate.proxy.protocol._sweep`), how long each sweep over at least half of them took.
- `cost` times ordinary requests through the same server: 16 MiB POSTs to `/tokenize` and
  small `GET /v1/models`, one at a time on one keep-alive connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from bench.experiments.upstreams import (
    port_of,
    reexec_with,
    serve,
    slotgate_origin,
    start_standin,
)
from bench.procs import raise_fd_limit

MIB = 1024 * 1024


def timed_sweeps() -> list[tuple[float, int]]:
    """(seconds, connections) of each head sweep, if this slotgate sweeps."""
    sweeps: list[tuple[float, int]] = []
    try:
        from slotgate.proxy import protocol
    except ImportError:
        return sweeps
    original: Callable[..., None] | None = getattr(protocol, "_sweep", None)
    if original is None:
        return sweeps
    sweep = original

    def timed(*args: Any) -> None:
        started = time.perf_counter()
        sweep(*args)
        sweeps.append((time.perf_counter() - started, len(args[1].connections)))

    protocol._sweep = timed  # type: ignore[assignment]
    return sweeps


async def loris(port: int, args: argparse.Namespace, sweeps: list[tuple[float, int]]) -> None:
    started = time.monotonic()
    connections = []
    for _ in range(args.connections):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        connections.append((reader, writer))
    opened_s = time.monotonic() - started

    async def trickle() -> None:
        while True:
            for _, writer in connections:
                if not writer.is_closing():
                    with contextlib.suppress(OSError):
                        writer.write(b"a")
            await asyncio.sleep(0.5)

    trickling = asyncio.create_task(trickle())
    async with httpx.AsyncClient() as client:
        before = time.perf_counter()
        health = (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code
        health_ms = (time.perf_counter() - before) * 1000

    answers: list[bytes] = []

    async def read(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError):
            answers.append(await reader.read())

    reads = [asyncio.create_task(read(reader)) for reader, _ in connections]
    _, pending = await asyncio.wait(reads, timeout=max(0.0, args.timeout_s - opened_s))
    closed_s = time.monotonic() - started
    trickling.cancel()
    for task in pending:
        task.cancel()
    for _, writer in connections:
        writer.close()
    timeouts = sum(answer.startswith(b"HTTP/1.1 408") for answer in answers)
    ending = (
        f"all closed by slotgate {closed_s:.1f} s after the first opened"
        if not pending
        else f"{len(pending)} still open at {closed_s:.1f} s (--timeout-s)"
    )
    print(
        f"{args.connections} trickling connections opened in {opened_s:.1f} s; {ending}; "
        f"408s: {timeouts}; /healthz meanwhile: {health} in {health_ms:.1f} ms",
        flush=True,
    )
    busy = [seconds for seconds, count in sweeps if count >= args.connections // 2]
    if busy:
        print(
            f"head sweeps: {len(sweeps)}; over >= {args.connections // 2} connections: "
            f"max {max(busy) * 1000:.2f} ms, mean {sum(busy) / len(busy) * 1000:.2f} ms"
        )
    else:
        print(f"head sweeps timed: {len(sweeps)} (none over half of the connections)")


async def cost(port: int, args: argparse.Namespace) -> None:
    body = b'{"content":"' + b"x" * (16 * MIB) + b'"}'
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await client.post("/tokenize", content=body)  # warm-up
        started = time.perf_counter()
        for _ in range(args.big):
            answer = await client.post("/tokenize", content=body)
            answer.raise_for_status()
        big_s = (time.perf_counter() - started) / args.big
        started = time.perf_counter()
        for _ in range(args.small):
            (await client.get("/v1/models")).raise_for_status()
        small_s = (time.perf_counter() - started) / args.small
    print(f"16 MiB POST /tokenize {big_s * 1000:.1f} ms; GET /v1/models {small_s * 1e6:.0f} us")


async def run(args: argparse.Namespace, upstream_url: str) -> None:
    sweeps = timed_sweeps()
    server, task = await serve(
        upstream_url, head_timeout_s=args.head_timeout_s, max_body_bytes=64 * MIB
    )
    try:
        port = port_of(server)
        part: Awaitable[None] = (
            loris(port, args, sweeps) if args.part == "loris" else cost(port, args)
        )
        await part
    finally:
        server.should_exit = True
        await task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("loris", "cost"))
    parser.add_argument("--connections", type=int, default=2200, help="loris: how many")
    parser.add_argument("--head-timeout-s", type=float, default=2.0, help="slotgate's bound")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="loris: longest wait")
    parser.add_argument("--big", type=int, default=10, help="cost: 16 MiB POSTs")
    parser.add_argument("--small", type=int, default=2000, help="cost: small GETs")
    parser.add_argument("--pythonpath", help="run the slotgate found here (before/after)")
    args = parser.parse_args(argv)
    reexec_with(args.pythonpath, "bench.experiments.slow_heads")
    raise_fd_limit()
    standin = start_standin()
    try:
        asyncio.run(run(args, f"http://127.0.0.1:{standin.port}"))
    finally:
        standin.stop()
    print(f"slotgate from: {slotgate_origin()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
