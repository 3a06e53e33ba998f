"""How ROUTING_EPSILON trades prompt-cache hits against queueing, on slotgate's own core.

A discrete-event simulation drives the real admission core (gate/admission.py, gate/routing.py)
with simulated time: conversations whose turns arrive as a Poisson stream, each turn holding
its slot for its generation, plus the prefill of its whole history when it lands on an
upstream that did not serve the conversation's last turn or has evicted it since (each
upstream keeps the prompts of its `--cache` most recent conversations, as llama-server's
slots and host-memory prompt cache do). It reports, per epsilon, with and without the memory
of each key's last upstream, and for least-loaded routing, the share of turns that hit the
cache and the time to completion (wait + hold), at a few loads.

Run as `python -m bench.experiments.epsilon`; prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import statistics
from collections import OrderedDict

from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.pool import Pool
from slotgate.gate.routing import stable_hash
from slotgate.gate.ticket import Ticket


class _Forgetful(OrderedDict[int, Pool]):
    """An affinity memory that remembers nothing: rendezvous order alone."""

    def __setitem__(self, key: int, value: Pool) -> None:
        pass

    def move_to_end(self, key: int, last: bool = True) -> None:
        pass


async def simulate(
    epsilon: float | None,
    load: float,
    *,
    sticky: bool,
    cache: int,
    slots: tuple[int, ...],
    conversations: int,
    turns: int,
    decode_s: float,
    prefill_s: float,
    seed: int,
) -> dict[str, float | str | None]:
    """One run; `epsilon` None routes by load alone."""
    rng = random.Random(seed)
    admission = Admission(QueuePolicy(max_queue=0), epsilon=epsilon or 0.0)
    if not sticky:
        admission._last = _Forgetful()
    for index, capacity in enumerate(slots):
        admission.add_pool(f"http://10.0.0.{index}:8080").resize(capacity)
    # Poisson arrivals at `load` x what the fleet serves when every turn hits the cache.
    rate = load * sum(slots) / decode_s
    events: list[tuple[float, int, str, object]] = []
    order = 0
    now = 0.0
    for _ in range(conversations * turns):
        now += rng.expovariate(rate)
        order += 1
        heapq.heappush(events, (now, order, "arrive", rng.randrange(conversations)))
    last: dict[int, Pool] = {}
    cached: dict[Pool, OrderedDict[int, None]] = {}
    arrived: dict[int, float] = {}
    conversation_of: dict[int, int] = {}
    waiting: list[Ticket] = []
    latencies: list[float] = []
    hits = 0

    def start(ticket: Ticket, at: float) -> None:
        nonlocal order, hits
        conversation = conversation_of[ticket.seq]
        pool = ticket.pool
        assert pool is not None
        recent = cached.setdefault(pool, OrderedDict())
        hit = last.get(conversation) is pool and conversation in recent
        hits += hit
        last[conversation] = pool
        recent[conversation] = None
        recent.move_to_end(conversation)
        if len(recent) > cache:
            recent.popitem(last=False)
        hold = decode_s + (0.0 if hit else prefill_s)
        order += 1
        heapq.heappush(events, (at + hold, order, "done", ticket))

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(data, int)
            key = stable_hash(f"conversation {data}") if epsilon is not None else None
            ticket = admission.enter(affinity=key)
            conversation_of[ticket.seq] = data
            arrived[ticket.seq] = now
            if ticket.granted:
                start(ticket, now)
            else:
                waiting.append(ticket)
            continue
        assert isinstance(data, Ticket)
        latencies.append(now - arrived[data.seq])
        data.release()
        still = []
        for ticket in waiting:
            if ticket.granted:
                start(ticket, now)
            else:
                still.append(ticket)
        waiting = still
    latencies.sort()
    return {
        "routing": "least-loaded" if epsilon is None else "affinity",
        "epsilon": epsilon,
        "sticky": sticky,
        "load": load,
        "cache_hit_share": round(hits / len(latencies), 3),
        "latency_mean_s": round(statistics.fmean(latencies), 3),
        "latency_p95_s": round(latencies[int(0.95 * len(latencies))], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--decode-s", type=float, default=1.0)
    parser.add_argument("--prefill-s", type=float, default=1.0)
    parser.add_argument("--slots", default="2,2,2")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--cache", type=int, default=8, help="conversations cached per upstream")
    parser.add_argument("--loads", default="0.3,0.5,0.7")
    args = parser.parse_args()
    slots = tuple(int(n) for n in args.slots.split(","))
    configurations = [(None, False)] + [
        (epsilon, sticky)
        for sticky in (False, True)
        for epsilon in (0.0, 0.1, 0.25, 0.5, 1.0, 10.0)
    ]
    for load in (float(n) for n in args.loads.split(",")):
        for epsilon, sticky in configurations:
            runs = [
                asyncio.run(
                    simulate(
                        epsilon,
                        load,
                        sticky=sticky,
                        cache=args.cache,
                        slots=slots,
                        conversations=args.conversations,
                        turns=args.turns,
                        decode_s=args.decode_s,
                        prefill_s=args.prefill_s,
                        seed=seed,
                    )
                )
                for seed in range(args.seeds)
            ]
            row = dict(runs[0])
            for field in ("cache_hit_share", "latency_mean_s", "latency_p95_s"):
                row[field] = round(statistics.fmean(float(r[field] or 0) for r in runs), 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
