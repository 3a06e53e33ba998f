"""What watching costs: slotgate's CPU at rest with no client of `GET /admission/events` and
with ten (each open status page is one), over a stand-in llama-server.

CPU is the user plus system time of the slotgate process, read from /proc before and after
each stretch (what `ps` shows), as a share of one core. Two rounds, so that a busy neighbour
shows as a difference between them. Linux only. The slotgate measured is the one this Python
imports (PYTHONPATH is passed on).

Run it as `python -m bench.status_watchers [--seconds 60] [--watchers 10]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.contenders import await_ready
from bench.procs import Server, free_port, spawn
from tests.support.standin import StandIn


async def share(gate: Server, seconds: float) -> float:
    """Percent of one core `gate` used over the next `seconds`."""
    cpu, start = gate.cpu_s(), time.monotonic()
    await asyncio.sleep(seconds)
    return (gate.cpu_s() - cpu) / (time.monotonic() - start) * 100


async def watch(url: str, counts: list[int]) -> None:
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(10, read=None)) as client,
        client.stream("GET", url + "/admission/events") as answer,
    ):
        async for chunk in answer.aiter_raw():
            counts[0] += chunk.count(b"data: ")


async def rounds(gate: Server, seconds: float, watchers: int) -> None:
    url = f"http://127.0.0.1:{gate.port}"
    await asyncio.sleep(3)
    print(f"| watchers | slotgate's CPU, % of one core, over {seconds:g} s |")
    print("|---|---|")
    for _ in range(2):
        print(f"| none | {await share(gate, seconds):.2f} |", flush=True)
        counts = [0]
        tasks = [asyncio.create_task(watch(url, counts)) for _ in range(watchers)]
        await asyncio.sleep(3)
        counts[0] = 0
        used = await share(gate, seconds)
        print(f"| {watchers} ({counts[0]} snapshots received) | {used:.2f} |", flush=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(3)
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


async def main(seconds: float, watchers: int) -> None:
    standin = StandIn()
    await standin.start()
    port = free_port()
    env = {"LLAMA_SERVER_URL": standin.url, "HOST": "127.0.0.1", "PORT": str(port),
           "LOG_LEVEL": "warning"}  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as logs:
            started = spawn(
                "slotgate", [sys.executable, "-m", "slotgate"], port, None, Path(logs), env
            )
            gate = await asyncio.to_thread(await_ready, started, "/readyz", 30)
            try:
                await rounds(gate, seconds, watchers)
            finally:
                gate.stop()
    finally:
        await standin.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--watchers", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.watchers))
