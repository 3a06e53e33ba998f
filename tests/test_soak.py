"""A long mixed run against slotgate as its own process: steady load, clients that drop, an
upstream restart half-way; memory, file descriptors and the pool must come back flat.

Run with `pytest -m soak`; SLOTGATE_SOAK_SECONDS sets the length (scripts/check: 60)."""

from __future__ import annotations

import asyncio
import os
import random
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from bench.procs import free_port
from tests.conftest import chat
from tests.support.standin import StandIn

pytestmark = pytest.mark.soak


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_soak_keeps_memory_descriptors_and_the_pool_flat(
    record_property: Callable[[str, object], None],
) -> None:
    seconds = float(os.environ.get("SLOTGATE_SOAK_SECONDS", "20"))
    standin = StandIn(total_slots=2, tokens=6, token_delay_s=0.01)
    await standin.start()
    port = free_port()
    env = {
        **os.environ, "PORT": str(port), "LLAMA_SERVER_URL": standin.url, "MAX_QUEUE": "16",
        "PROPS_REFRESH_INTERVAL_S": "0.5", "LOG_LEVEL": "warning", "KEEPALIVE_INTERVAL_S": "0.5",
    }  # fmt: skip
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "slotgate", env=env)
    url = f"http://127.0.0.1:{port}"
    outcomes: Counter[str] = Counter()
    rng = random.Random(5)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    try:
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            async with asyncio.timeout(30):
                while True:
                    try:
                        if (await client.get(url + "/readyz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
            loop = asyncio.get_running_loop()
            end = loop.time() + seconds

            async def user() -> None:
                while loop.time() < end:
                    stream = rng.random() < 0.5
                    drop = rng.random() < 0.1
                    try:
                        async with client.stream(
                            "POST", url + "/v1/chat/completions", json=chat(stream=stream)
                        ) as response:
                            if drop:
                                outcomes["dropped"] += 1
                                continue
                            await response.aread()
                            outcomes[str(response.status_code)] += 1
                    except httpx.TransportError:
                        outcomes["transport_error"] += 1
                    if response.status_code != 200:
                        await asyncio.sleep(0.05)

            async def restart_upstream_half_way() -> None:
                await asyncio.sleep(seconds / 2)
                await standin.stop()
                await asyncio.sleep(1.0)
                standin.total_slots = 3
                await standin.start()

            samples: list[tuple[int, int]] = []

            async def sample() -> None:
                while loop.time() < end:
                    samples.append((rss_kib(proc.pid), open_fds(proc.pid)))
                    await asyncio.sleep(1)

            await asyncio.gather(
                *(user() for _ in range(12)), restart_upstream_half_way(), sample()
            )
            async with asyncio.timeout(15):
                while True:
                    pool = (await client.get(url + "/admission")).json()
                    if (pool["active"], pool["queued"]) == (0, 0):
                        break
                    await asyncio.sleep(0.1)
            assert pool["capacity"] == 3  # the restart's new --parallel was picked up
            await asyncio.sleep(5)  # idle keep-alive connections upstream expire after 4 s
            end_rss, end_fds = rss_kib(proc.pid), open_fds(proc.pid)
    finally:
        proc.terminate()
        code = await proc.wait()
        await standin.stop()
    warm_rss, warm_fds = samples[len(samples) // 4]
    record_property("requests", sum(outcomes.values()))
    record_property("outcomes", dict(outcomes))
    record_property("rss_kib_warm_end", (warm_rss, end_rss))
    record_property("fds_warm_end", (warm_fds, end_fds))
    print(f"soak: {dict(outcomes)} rss warm={warm_rss} end={end_rss} KiB "  # noqa: T201
          f"fds warm={warm_fds} end={end_fds}")  # fmt: skip
    assert code == 0
    assert outcomes["200"] > 100
    # Nothing but served, refused with a retry hint, or refused while llama-server restarted.
    assert set(outcomes) <= {"200", "429", "503", "dropped"}, outcomes
    assert end_rss < warm_rss * 1.15 + 2048
    assert end_fds <= warm_fds
