"""What watching costs: slotgate's CPU at rest with no client of `GET /admission/events` and
with ten (each open status page is one), over a stand-in llama-server.

CPU is the user plus system time of the slotgate process, read from /proc before and after
each stretch (what `ps` shows), as a share of one core. Two rounds, so that a busy neighbour
shows as a difference between them. Linux only. The slotgate measured is the one this Python
imports (PYTHONPATH is passed on).

With `--waiting N`, the stand-in's slots are first held by long generations and N more
requests wait in the line, unmoving, through both stretches: each snapshot then lists the 50
longest waits and reads every tenant's counts, the most a snapshot does.

With `--load RATE`, both stretches run under an open loop of RATE plain chat completions a
second (the stand-in answers at once, on 256 slots; this process sends them and reads the
answers), so that the watchers' cost shows beside a loaded request path.

Run it as `python -m bench.status_watchers [--seconds 60] [--watchers 10] [--waiting 0]
[--load 0]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx

from bench.contenders import start_slotgate_over
from bench.loadgen import chat_body, open_loop, request_bytes
from bench.procs import Server
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


async def wait_in_line(port: int, count: int) -> list[asyncio.StreamWriter]:
    """`count` chats sent on connections of their own and never read: each holds a slot, or a
    place in the line, until its connection closes."""
    body = b'{"messages":[{"role":"user","content":"hi"}],"stream":true}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        writers.append(writer)
    return writers


async def loaded(gate: Server, seconds: float, load: float) -> float:
    """`share` over `seconds` while an open loop sends `load` chats a second; 0 load: at rest."""
    if not load:
        return await share(gate, seconds)
    raw = request_bytes(gate.port, "/v1/chat/completions", chat_body(stream=False, max_tokens=4))
    sending = asyncio.create_task(open_loop(gate.port, raw, 256, load, seconds + 2))
    await asyncio.sleep(1)
    used = await share(gate, seconds)
    result, starved = await sending
    answered = sum(result.statuses.values())
    print(f"  (load: {result.statuses[200]} of {answered} answered 200, {starved} starved)")
    return used


async def rounds(gate: Server, seconds: float, watchers: int, waiting: int, load: float) -> None:
    url = f"http://127.0.0.1:{gate.port}"
    held = await wait_in_line(gate.port, waiting)
    async with httpx.AsyncClient() as client, asyncio.timeout(60):
        while waiting:
            if (await client.get(url + "/admission")).json()["queued"] >= waiting - 2:
                break
            await asyncio.sleep(0.5)
    await asyncio.sleep(3)
    if waiting:
        print(f"{waiting} requests sent; the slots are held and the rest wait in line")
    if load:
        print(f"under an open loop of {load:g} chat completions a second")
    print(f"| watchers | slotgate's CPU, % of one core, over {seconds:g} s |")
    print("|---|---|")
    for _ in range(2):
        print(f"| none | {await loaded(gate, seconds, load):.2f} |", flush=True)
        counts = [0]
        tasks = [asyncio.create_task(watch(url, counts)) for _ in range(watchers)]
        await asyncio.sleep(3)
        counts[0] = 0
        used = await loaded(gate, seconds, load)
        print(f"| {watchers} ({counts[0]} snapshots received) | {used:.2f} |", flush=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(3)
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for writer in held:
        writer.close()


async def main(seconds: float, watchers: int, waiting: int, load: float) -> None:
    # Two slots; a generation lasts 100 s unless the line is left alone. Under load: answers
    # at once, on slots enough for the open loop.
    standin = (
        StandIn(total_slots=256, tokens=4, record=False)
        if load
        else StandIn(total_slots=2, tokens=2000, token_delay_s=0.05, record=False)
    )
    await standin.start()
    env = {"MAX_QUEUE": "0", "KEEPALIVE_INTERVAL_S": "0"}
    try:
        with tempfile.TemporaryDirectory() as logs:
            gate = await start_slotgate_over(standin.url, Path(logs), env)
            try:
                await rounds(gate, seconds, watchers, waiting, load)
            finally:
                gate.stop()
    finally:
        await standin.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--watchers", type=int, default=10)
    parser.add_argument("--waiting", type=int, default=0)
    parser.add_argument("--load", type=float, default=0.0, help="chats a second, open loop")
    args = parser.parse_args()
    asyncio.run(main(args.seconds, args.watchers, args.waiting, args.load))
