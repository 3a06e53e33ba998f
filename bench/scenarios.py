"""Scenarios 1-5 and the burst: each drives one started server and returns plain figures.

Every figure here is taken on the load generator's core (1) against a server on core 0; CPU
time is read from /proc for the server's own processes, so the stand-in's and the load
generator's share of core 1 never counts against a contender.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotgate.upstreams.reuse import STREAM_PROBE_S

from bench import loadgen
from bench.contenders import (
    REPO,
    configure_standin,
    standin_stats,
    start_floor,
    start_slotgate,
)
from bench.loadgen import Exchange, chat_body, closed_loop, connect, fetch, request_bytes
from bench.loop import run_loop
from bench.procs import (
    CLIENT_CORE,
    SERVER_CORE,
    Server,
    pin_self,
    pinning_possible,
    rss_bytes,
    wait_until,
)
from bench.stats import difference, ms

CHAT = "/v1/chat/completions"


@dataclass
class Sizes:
    """How big and how long each scenario runs; `--quick` and the smoke test shrink these."""

    duration_s: float = 8.0
    warmup_s: float = 1.0
    concurrency: tuple[int, ...] = (1, 8, 32, 128)
    stream_tokens: int = 64
    stream_latency_delay_s: float = 0.002
    stream_concurrency: int = 64
    stream_throughput_delay_s: float = 0.001
    storm_clients: int = 1000
    storm_queue: int = 64
    # The open loop's offered rate of refused requests per second; 0: half the closed loop's
    # rate. Set it to compare two trees at one offered load (their closed-loop rates differ).
    storm_rate: float = 0.0
    handoff_clients: int = 16
    handoff_hold_s: float = 0.002
    waiters: int = 10_000
    core_pairs: int = 300_000
    core_depth: int = 10_000
    core_repeats: int = 3
    burst_clients: int = 400
    burst_slots: int = 4
    burst_hold_s: float = 0.02
    low_slots: int = 4
    llama_seconds: float = 40.0
    llama_rounds: int = 2
    llama_clients: int = 4
    llama_max_tokens: int = 48
    loadgen: str = "auto"  # auto | wrk | python
    # The fleet scenarios (bench/fleet.py, issue 18).
    fleet_engines: int = 3
    fleet_engine_slots: int = 2
    fleet_ctx_size: int = 2048
    fleet_swa_full: int = 1  # 1: the engines run with llama-server's --swa-full (bench/fleet.py)
    fleet_systems: int = 4
    fleet_system_words: int = 260
    fleet_conversations: int = 12
    # Answers of 64 tokens over 5 turns, so that a conversation's history counts beside its
    # system prompt; at most one conversation per slot, so that time to first token measures
    # routing rather than a saturated line (the saturated run: --fleet-clients 12
    # --fleet-turns 4 --fleet-max-tokens 16, the reference until 2026-12-01 05:40).
    fleet_turns: int = 5
    fleet_max_tokens: int = 64
    fleet_clients: int = 6
    fleet_think_s: float = 3.0
    fleet_stagger_s: float = 0.5
    fleet_cost_upstreams: int = 8
    fleet_cost_slots: int = 64
    fleet_cost_clients: int = 16
    fleet_cost_rounds: int = 3
    fleet_balance_slots: tuple[int, ...] = (1, 2, 4)
    fleet_balance_hold_s: float = 0.02
    fleet_balance_load: float = 0.5

    def uses_wrk(self) -> bool:
        if self.loadgen == "python":
            return False
        if self.loadgen == "wrk":
            return True
        return loadgen.wrk_available()


@dataclass
class Context:
    sizes: Sizes
    logs: Path
    standin: Server
    notes: list[str] = field(default_factory=list)


# -- scenario 1: non-streamed chat completions --


def nonstream(ctx: Context, server: Server) -> dict[str, Any]:
    """Requests/s, p50/p99 latency and server CPU per 1,000 requests at each concurrency."""
    sizes = ctx.sizes
    configure_standin(ctx.standin, tokens=16, token_delay_s=0, hold_s=0, record_gaps=False)
    body = chat_body(stream=False)
    raw = request_bytes(server.port, CHAT, body)
    rows: dict[str, Any] = {}
    for concurrency in sizes.concurrency:
        run_loop(closed_loop(server.port, raw, concurrency, sizes.warmup_s))
        cpu_before, wall_before = server.cpu_s(), time.monotonic()
        if sizes.uses_wrk():
            result = loadgen.wrk(server.port, CHAT, body, concurrency, sizes.duration_s)
            requests = int(result["requests"])
            duration_s = result["duration_us"] / 1e6
            failures = sum(
                int(result[k]) for k in ("connect", "read", "write", "status", "timeout")
            )
            p50, p99 = result["p50_us"] / 1e3, result["p99_us"] / 1e3
            tool = "wrk"
        else:
            loop_result = run_loop(closed_loop(server.port, raw, concurrency, sizes.duration_s))
            requests = loop_result.statuses[200]
            duration_s = loop_result.duration_s
            failures = loop_result.errors + loop_result.completed - requests
            p50, p99 = ms(loop_result.latencies_ns, 50), ms(loop_result.latencies_ns, 99)
            tool = "python"
        cpu = server.cpu_s() - cpu_before
        wall = time.monotonic() - wall_before
        rows[str(concurrency)] = {
            "rps": round(requests / duration_s, 1) if duration_s else None,
            "p50_ms": p50,
            "p99_ms": p99,
            "requests": requests,
            "failures": failures,
            "cpu_s_per_1k": round(cpu / requests * 1000, 4) if requests else None,
            "server_core_util": round(cpu / wall, 3),
            "loadgen": tool,
        }
    return rows


# -- scenario 2: streamed chat completions --


def stream(ctx: Context, server: Server) -> dict[str, Any]:
    """Chunk latency at concurrency 1, then chunk throughput with many streams at once."""
    sizes = ctx.sizes
    raw = request_bytes(server.port, CHAT, chat_body(stream=True, max_tokens=sizes.stream_tokens))
    configure_standin(
        ctx.standin,
        tokens=sizes.stream_tokens,
        token_delay_s=sizes.stream_latency_delay_s,
        hold_s=0,
    )
    quiet = run_loop(closed_loop(server.port, raw, 1, sizes.duration_s, sizes.warmup_s, True))
    latency = quiet.stream
    assert latency is not None
    configure_standin(
        ctx.standin, tokens=sizes.stream_tokens, token_delay_s=sizes.stream_throughput_delay_s
    )
    run_loop(closed_loop(server.port, raw, sizes.stream_concurrency, sizes.warmup_s, 0, True))
    cpu_before, wall_before = server.cpu_s(), time.monotonic()
    busy = run_loop(
        closed_loop(server.port, raw, sizes.stream_concurrency, sizes.duration_s, 0, True)
    )
    cpu = server.cpu_s() - cpu_before
    wall = time.monotonic() - wall_before
    throughput = busy.stream
    assert throughput is not None
    return {
        "latency_c1": {
            "streams": quiet.completed,
            "tokens": latency.tokens,
            "chunk_transit_p50_ms": ms(latency.transit_ns, 50),
            "chunk_transit_p99_ms": ms(latency.transit_ns, 99),
            "inter_chunk_gap_p50_ms": ms(latency.gaps_ns, 50),
            "inter_chunk_gap_p99_ms": ms(latency.gaps_ns, 99),
            "ttfb_p50_ms": ms(latency.ttfb_ns, 50),
            "ttft_p50_ms": ms(latency.ttft_ns, 50),
            "ttft_p99_ms": ms(latency.ttft_ns, 99),
            "failures": quiet.errors + quiet.completed - quiet.statuses[200],
        },
        "throughput": {
            "concurrency": sizes.stream_concurrency,
            "chunks_per_s": round(throughput.tokens / busy.duration_s, 1),
            "offered_chunks_per_s": round(
                sizes.stream_concurrency / sizes.stream_throughput_delay_s, 1
            ),
            "streams": busy.completed,
            "chunk_transit_p50_ms": ms(throughput.transit_ns, 50),
            "chunk_transit_p99_ms": ms(throughput.transit_ns, 99),
            "cpu_s_per_1k_chunks": round(cpu / throughput.tokens * 1000, 4)
            if throughput.tokens
            else None,
            "server_core_util": round(cpu / wall, 3),
            "failures": busy.errors + busy.completed - busy.statuses[200],
        },
    }


# -- helpers for the slotgate-only scenarios --


@contextlib.contextmanager
def slotgate(ctx: Context, name: str, slots: int, **env: str) -> Iterator[Server]:
    configure_standin(ctx.standin, slots=slots)
    server = start_slotgate(name, f"http://127.0.0.1:{ctx.standin.port}", ctx.logs, env)
    try:
        yield server
    finally:
        server.stop()


def pool(server: Server) -> dict[str, Any]:
    _, body = loadgen.http_json(server.port, "/admission")
    assert isinstance(body, dict)
    return body


def _await_pool(server: Server, timeout_s: float, **want: int) -> None:
    wait_until(
        lambda: all(pool(server)[k] == v for k, v in want.items()),
        timeout_s,
        f"slotgate pool {want}",
        step_s=0.2,
    )


async def hold(port: int, count: int, path: str) -> list[Exchange]:
    """`count` connections whose requests the stand-in never answers (they hold slots)."""
    exchanges = await connect(port, count)
    raw = request_bytes(port, path, chat_body(stream=False))
    for exchange in exchanges:
        exchange.send(raw, None)
    return exchanges


def release(exchanges: list[Exchange]) -> None:
    for exchange in exchanges:
        exchange.close()


# -- scenario 3: storm of 429s --


def storm(ctx: Context) -> dict[str, Any]:
    """1,000 clients against a full line: closed loop for the rate, then open loop for p99."""
    sizes = ctx.sizes
    slots = 2
    with slotgate(ctx, "slotgate-storm", slots, MAX_QUEUE=str(sizes.storm_queue)) as server:

        async def run() -> dict[str, Any]:
            holders = await hold(server.port, slots + sizes.storm_queue, CHAT + "?hang=1")
            try:
                await asyncio.to_thread(
                    _await_pool, server, 30, active=slots, queued=sizes.storm_queue
                )
                raw = request_bytes(server.port, CHAT, chat_body(stream=False))
                await closed_loop(server.port, raw, sizes.storm_clients, sizes.warmup_s)
                cpu_before = server.cpu_s()
                closed = await closed_loop(server.port, raw, sizes.storm_clients, sizes.duration_s)
                cpu = server.cpu_s() - cpu_before
                rate = closed.statuses[429] / closed.duration_s
                offered = sizes.storm_rate or max(rate * 0.5, 1.0)
                opened, starved = await loadgen.open_loop(
                    server.port, raw, sizes.storm_clients, offered, sizes.duration_s
                )
            finally:
                release(holders)
            return {
                "clients": sizes.storm_clients,
                "line": f"{slots} slots held, {sizes.storm_queue} waiting (MAX_QUEUE)",
                "closed_loop": {
                    "rejections_per_s": round(rate, 1),
                    "p50_ms": ms(closed.latencies_ns, 50),
                    "p99_ms": ms(closed.latencies_ns, 99),
                    # Little's law: clients that re-fire at once wait, on average, clients /
                    # rate, whatever the server; the p99 cannot be below this mean.
                    "littles_law_mean_ms": round(sizes.storm_clients / rate * 1000, 2)
                    if rate
                    else None,
                    "statuses": {str(k): v for k, v in closed.statuses.items()},
                    "errors": closed.errors,
                    "cpu_s_per_1k": round(cpu / closed.completed * 1000, 4)
                    if closed.completed
                    else None,
                },
                "open_loop": {
                    "offered_per_s": round(offered, 1),
                    "rejections_per_s": round(opened.statuses[429] / opened.duration_s, 1),
                    "p50_ms": ms(opened.latencies_ns, 50),
                    "p99_ms": ms(opened.latencies_ns, 99),
                    "statuses": {str(k): v for k, v in opened.statuses.items()},
                    "client_starved": starved,
                },
            }

        return run_loop(run())


# -- scenario 3b: hand-off with a line that never empties --


def handoff(ctx: Context) -> dict[str, Any]:
    """How long a freed slot stays idle at the upstream before the next admitted request."""
    sizes = ctx.sizes
    slots = 2
    result: dict[str, Any] = {
        "slots": slots,
        "clients": sizes.handoff_clients,
        "generation_s": sizes.handoff_hold_s,
    }
    with slotgate(ctx, "slotgate-handoff", slots, MAX_QUEUE="0") as server:
        configure_standin(
            ctx.standin,
            slots=slots,
            tokens=16,
            hold_s=sizes.handoff_hold_s,
            token_delay_s=0,
            record_gaps=True,
        )
        raw = request_bytes(server.port, CHAT, chat_body(stream=False))
        # Warmed up first, past the gate's first STREAM_PROBE_S with this upstream: until it
        # has learned whether the upstream keeps a connection open after an event stream, it
        # opens a new one for each request (app/upstreams/reuse.py), which is start-up, not
        # the hand-off that goes on all day. The gaps are counted afresh after it.
        run_loop(
            closed_loop(server.port, raw, sizes.handoff_clients, sizes.warmup_s + STREAM_PROBE_S)
        )
        configure_standin(ctx.standin, record_gaps=True)
        run = run_loop(closed_loop(server.port, raw, sizes.handoff_clients, sizes.duration_s))
        gaps = list(_gaps(ctx))
        result["slotgate"] = _gap_summary(gaps, run.rate)
    # For scale: two clients straight at the upstream, each sending its next request as soon
    # as its answer ends. On the stand-in's core they cross no core. On slotgate's core they
    # cross cores twice per hand-off, as slotgate does (the last byte wakes them there, their
    # next request wakes the stand-in): the floor under slotgate's figure on this machine, of
    # which slotgate's own part is the difference.
    result["direct_2_clients"] = _direct_gaps(ctx, slots)
    if pinning_possible():
        pin_self(SERVER_CORE)
        try:
            across = result["direct_2_clients_across_cores"] = _direct_gaps(ctx, slots)
        finally:
            pin_self(CLIENT_CORE)
        result["slotgate_over_across_cores_ms"] = {
            q: difference(result["slotgate"][f"idle_{q}_ms"], across[f"idle_{q}_ms"])
            for q in ("p50", "p99")
        }
    configure_standin(ctx.standin, hold_s=0, record_gaps=False)
    return result


def _direct_gaps(ctx: Context, slots: int) -> dict[str, Any]:
    configure_standin(ctx.standin, slots=slots, hold_s=ctx.sizes.handoff_hold_s, record_gaps=True)
    raw = request_bytes(ctx.standin.port, CHAT, chat_body(stream=False))
    run = run_loop(closed_loop(ctx.standin.port, raw, slots, ctx.sizes.duration_s))
    return _gap_summary(list(_gaps(ctx)), run.rate)


def _gaps(ctx: Context) -> Iterator[int]:
    gaps = standin_stats(ctx.standin)["gaps_ns"]
    assert isinstance(gaps, list)
    return (int(gap) for gap in gaps)


def _gap_summary(gaps: list[int], rate: float) -> dict[str, Any]:
    return {
        "handoffs": len(gaps),
        "idle_p50_ms": ms(gaps, 50),
        "idle_p99_ms": ms(gaps, 99),
        "idle_max_ms": ms(gaps, 100),
        "requests_per_s": round(rate, 1),
    }


# -- scenario 4: memory per waiting request --


def memory(ctx: Context) -> dict[str, Any]:
    """RSS of slotgate with `waiters` requests in line, over its RSS with the line empty; and
    the same for bare uvicorn holding as many requests (bench/floor.py), the floor under it."""
    waiters = ctx.sizes.waiters
    with slotgate(ctx, "slotgate-memory", 1, MAX_QUEUE="0") as server:

        async def run() -> dict[str, Any]:
            holder = await hold(server.port, 1, CHAT + "?hang=1")
            try:
                return await fill_line(server, waiters, lambda n: pool(server)["queued"] == n)
            finally:
                release(holder)

        result = run_loop(run())
    floor = start_floor(ctx.logs, answer=False)
    try:
        held = run_loop(fill_line(floor, waiters, lambda n: held_by_floor(floor) == n))
    finally:
        floor.stop()
    result["uvicorn_floor_kb_per_request"] = held["kb_per_waiter"]
    result["slotgate_own_kb_per_waiter"] = round(result["kb_per_waiter"] - held["kb_per_waiter"], 2)
    return result


async def fill_line(server: Server, waiters: int, holding: Callable[[int], bool]) -> dict[str, Any]:
    # Warm every code path a waiter takes, then let those waiters go again.
    warm = await hold(server.port, 100, CHAT)
    await asyncio.to_thread(wait_until, lambda: holding(100), 30, "100 held", 0.2)
    release(warm)
    await asyncio.to_thread(wait_until, lambda: holding(0), 30, "none held", 0.2)
    await asyncio.sleep(0.5)
    before = _rss(server)
    started = time.monotonic()
    line = await hold(server.port, waiters, CHAT)
    try:
        await asyncio.to_thread(wait_until, lambda: holding(waiters), 180, "all held", 0.2)
        filled_s = time.monotonic() - started
        await asyncio.sleep(0.5)
        after = _rss(server)
    finally:
        release(line)
    return {
        "waiters": waiters,
        "rss_empty_mb": round(before / 2**20, 1),
        "rss_full_mb": round(after / 2**20, 1),
        "kb_per_waiter": round((after - before) / waiters / 1024, 2),
        "fill_s": round(filled_s, 2),
    }


def _rss(server: Server) -> int:
    # The whole tree: a server may serve from a worker process of its own (granian does).
    return sum(rss_bytes(pid) for pid in server.pids())


def held_by_floor(server: Server) -> int:
    _, body = loadgen.http_json(server.port, "/held")
    assert isinstance(body, dict)
    return int(body["held"])


# -- scenario 5: the admission core alone --


def core(ctx: Context) -> dict[str, Any]:
    sizes = ctx.sizes
    command = [
        sys.executable,
        "-m",
        "bench.core",
        "--pairs",
        str(sizes.core_pairs),
        "--depth",
        str(sizes.core_depth),
        "--repeats",
        str(sizes.core_repeats),
    ]
    pin = pinning_possible()

    def setup() -> None:
        if pin:
            os.sched_setaffinity(0, {SERVER_CORE})

    done = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO, timeout=600, check=True, preexec_fn=setup
    )
    figures: dict[str, Any] = json.loads(done.stdout)
    figures["depth"] = sizes.core_depth
    return figures


# -- the burst, for the queue plot --


def burst(ctx: Context) -> dict[str, Any]:
    """`burst_clients` requests at once on a small pool; /admission sampled every 20 ms."""
    sizes = ctx.sizes
    with slotgate(ctx, "slotgate-burst", sizes.burst_slots, MAX_QUEUE="0") as server:
        configure_standin(
            ctx.standin, hold_s=sizes.burst_hold_s, tokens=16, token_delay_s=0, record_gaps=False
        )

        async def run() -> dict[str, Any]:
            [probe] = await connect(server.port, 1)
            ask = request_bytes(server.port, "/admission", None, method="GET")
            clients = await connect(server.port, sizes.burst_clients)
            raw = request_bytes(server.port, CHAT, chat_body(stream=False))
            samples: list[dict[str, float]] = []
            finished: list[float] = []
            all_done = asyncio.Event()
            origin = time.monotonic()

            def done(_: Exchange, status: int) -> None:
                finished.append(time.monotonic() - origin)
                if len(finished) == len(clients):
                    all_done.set()

            async def sample() -> None:
                while True:
                    status, body = await fetch(probe, ask)
                    now = time.monotonic() - origin
                    if status == 200:
                        snap = json.loads(body)
                        samples.append(
                            {
                                "t_s": round(now, 4),
                                "active": snap["active"],
                                "queued": snap["queued"],
                                "done": len(finished),
                            }
                        )
                    await asyncio.sleep(0.02)

            sampler = asyncio.create_task(sample())
            await asyncio.sleep(0.2)
            fired = time.monotonic() - origin
            for client in clients:
                client.send(raw, done)
            async with asyncio.timeout(120):
                await all_done.wait()
            await asyncio.sleep(0.2)
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            release([probe, *clients])
            return {
                "clients": sizes.burst_clients,
                "slots": sizes.burst_slots,
                "generation_s": sizes.burst_hold_s,
                "fired_at_s": round(fired, 4),
                "drain_s": round(max(finished) - fired, 3) if finished else None,
                "ideal_drain_s": round(
                    sizes.burst_clients / sizes.burst_slots * sizes.burst_hold_s, 3
                ),
                "max_queued": max((s["queued"] for s in samples), default=0),
                "samples": samples,
            }

        result = run_loop(run())
        configure_standin(ctx.standin, hold_s=0)
        return result
