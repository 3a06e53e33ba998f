"""The event loop's worst stall while slotgate takes one big request body, and why a thread
would not help.

    python -m bench.experiments.big_bodies gate [--mib 31] [--on-loop] [--pythonpath DIR]
    python -m bench.experiments.big_bodies parse [--mib 32]

Issue 13, point 13: parsing a 32 MiB body stalled the event loop for up to 0.75 s, so every
other client waited. Three bodies of about `--mib` MiB: a prompt of token ids, many short
messages, one long string.
- `gate`: slotgate runs in this process, as `slotgate` runs it, in front of tests/support/standin.py
  in a process of its own (so only slotgate's work shows); a 1 ms ticker on slotgate's loop
  records the worst gap while each body is POSTed twice (the first also starts the worker
  pool). `--on-loop` sets `slotgate.intake.body.OFF_LOOP_BYTES` out of reach, so every body is
  taken on the loop as before app/intake/body.py's worker process.
- `parse`: orjson alone on each body, `loads` and `loads` + `dumps`, on the loop and in
  `asyncio.to_thread`: a thread holds the GIL through the parse, so it stalls the loop as long.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable

import httpx
import orjson

from bench.experiments.upstreams import (
    port_of,
    reexec_with,
    serve,
    slotgate_origin,
    start_standin,
)

MIB = 1024 * 1024


def bodies(mib: int) -> dict[str, tuple[str, bytes]]:
    """Name: (path, body) of about `mib` MiB each."""
    size = mib * MIB
    ids = list(range(10**6, 10**6 + size // 8))
    many = [{"role": "user", "content": "hello world"}] * (size // 50)
    return {
        "token ids": ("/completion", orjson.dumps({"prompt": ids, "n_predict": 1})),
        "messages": ("/v1/chat/completions", orjson.dumps({"messages": many, "max_tokens": 1})),
        "one string": (
            "/v1/chat/completions",
            orjson.dumps({"messages": [{"role": "user", "content": "x" * size}], "max_tokens": 1}),
        ),
    }


class Ticker:
    """The worst gap beyond 1 ms between wake-ups of a 1 ms sleep on this loop."""

    def __init__(self) -> None:
        self.worst_s = 0.0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *_: object) -> None:
        await asyncio.sleep(0.05)
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst_s = max(self.worst_s, now - last - 0.001)
            last = now


async def gate(args: argparse.Namespace, upstream_url: str) -> None:
    if args.on_loop:
        from slotgate.intake import body as intake

        intake.OFF_LOOP_BYTES = 10**12  # everything on the loop
    server, task = await serve(
        upstream_url, max_body_bytes=(args.mib + 8) * MIB, queue_body_bytes=0,
        props_refresh_interval_s=0.2,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port_of(server)}"
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for name, (path, body) in bodies(args.mib).items():
                for attempt in range(2):
                    async with Ticker() as ticker:
                        started = time.perf_counter()
                        answer = await client.post(
                            path, content=body, headers={"content-type": "application/json"}
                        )
                        took_s = time.perf_counter() - started
                    print(
                        f"{name:10s} {len(body) / MIB:5.1f} MiB try {attempt} "
                        f"status {answer.status_code} request {took_s * 1000:5.0f} ms "
                        f"worst loop stall {ticker.worst_s * 1000:4.0f} ms",
                        flush=True,
                    )
    finally:
        server.should_exit = True
        await task


def _loads(body: bytes) -> None:
    orjson.loads(body)


def _loads_dumps(body: bytes) -> None:
    orjson.dumps(orjson.loads(body))


async def parse(args: argparse.Namespace) -> None:
    steps: dict[str, Callable[[bytes], None]] = {"loads": _loads, "loads+dumps": _loads_dumps}
    for name, (_, body) in bodies(args.mib).items():
        for step, work in steps.items():
            for threaded in (False, True):
                async with Ticker() as ticker:
                    started = time.perf_counter()
                    if threaded:
                        await asyncio.to_thread(work, body)
                    else:
                        work(body)
                    took_s = time.perf_counter() - started
                where = "in a thread" if threaded else "on the loop"
                print(
                    f"{name:10s} {len(body) / MIB:5.1f} MiB {step:11s} {where:11s} "
                    f"took {took_s * 1000:5.0f} ms, "
                    f"worst loop stall {ticker.worst_s * 1000:5.0f} ms",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("gate", "parse"))
    parser.add_argument("--mib", type=int, default=31, help="size of each body")
    parser.add_argument("--on-loop", action="store_true", help="gate: no worker process")
    parser.add_argument("--pythonpath", help="gate: run the slotgate found here")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on the whole run")
    args = parser.parse_args(argv)
    if args.part == "parse":
        asyncio.run(asyncio.wait_for(parse(args), args.timeout_s))
        return 0
    reexec_with(args.pythonpath, "bench.experiments.big_bodies")
    standin = start_standin(tokens=1)
    try:
        coroutine = gate(args, f"http://127.0.0.1:{standin.port}")
        asyncio.run(asyncio.wait_for(coroutine, args.timeout_s))
    finally:
        standin.stop()
    print(f"on the loop: {args.on_loop}; slotgate from: {slotgate_origin()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
