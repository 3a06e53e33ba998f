"""The fair line's own cost per waiter, beside the plain FIFO deque it would replace.

    python -m bench.experiments.fairline [--ops 200000] [--waiters 10000] [--tenants 1000]

Issue 19: the ordering core must stay O(log tenants) or better per operation at 10,000
waiters and 1,000 tenants, and the one-tenant case must not cost the admission core more than
10%. Each figure is nanoseconds per pair at a steady depth (best of `--repeats`), one process,
no event loop running (the futures are real asyncio futures, never awaited):

- `deque`: today's line: `append` at the back; the head's `future.done()` read, `popleft`.
- `push+pop`: `FairLine.push` and `head` + `pop_head`.
- `cycle`: the same plus `granted` and `released` of the ticket popped, as each grant does.
- `core handoff`: the whole admission core per request at the same depth, one slot held
  (`bench.core.handoff`: enter, release, hand the slot on, wait), for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from collections.abc import Callable
from functools import partial

from slotgate.fairline import FairLine
from slotgate.tenants import Tenant

from bench.core import handoff
from bench.loop import run_loop


class Ticket:
    __slots__ = ("_future", "band", "seq", "tenant", "weight")

    def __init__(self, tenant: Tenant, seq: int, future: asyncio.Future[None]) -> None:
        self.tenant = tenant
        self.band = tenant.band
        self.weight = 1
        self.seq = seq
        self._future: asyncio.Future[None] | None = future


def _tickets(loop: asyncio.AbstractEventLoop, tenants: int, count: int) -> list[Ticket]:
    names = [Tenant(f"t{n}", weight=1 + n % 3) for n in range(tenants)]
    return [Ticket(names[n % tenants], n, loop.create_future()) for n in range(count)]


def deque_pairs(tickets: list[Ticket], depth: int) -> float:
    line: collections.deque[Ticket] = collections.deque(tickets[:depth])
    started = time.perf_counter_ns()
    for ticket in tickets[depth:]:
        line.append(ticket)
        future = line[0]._future
        if future is not None and future.done():
            raise AssertionError
        line.popleft()
    return (time.perf_counter_ns() - started) / (len(tickets) - depth)


def fair_pairs(tickets: list[Ticket], depth: int, cycle: bool) -> float:
    line: FairLine[Ticket] = FairLine()
    for ticket in tickets[:depth]:
        line.push(ticket)
    started = time.perf_counter_ns()
    if cycle:
        for ticket in tickets[depth:]:
            line.push(ticket)
            line.head()
            popped = line.pop_head()
            line.granted(popped)
            line.released(popped, 0.5 + (popped.seq % 7) / 7)
    else:
        for ticket in tickets[depth:]:
            line.push(ticket)
            line.head()
            line.pop_head()
    elapsed = time.perf_counter_ns() - started
    assert len(line) == depth
    return elapsed / (len(tickets) - depth)


def best(repeats: int, measure: Callable[[], float]) -> float:
    return round(min(measure() for _ in range(repeats)), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--waiters", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    try:
        depth, ops, repeats = args.waiters, args.ops, args.repeats
        results: dict[str, float] = {}
        for tenants in (1, args.tenants):
            tickets = _tickets(loop, tenants, depth + ops)
            label = f"{tenants}_tenant{'s' if tenants > 1 else ''}"
            results[f"deque_{label}_ns"] = best(repeats, partial(deque_pairs, tickets, depth))
            for cycle in (False, True):
                name = f"{'cycle' if cycle else 'push_pop'}_{label}_ns"
                results[name] = best(repeats, partial(fair_pairs, tickets, depth, cycle))
    finally:
        loop.close()
    pairs_s = run_loop(handoff(ops, depth))
    results["core_handoff_ns"] = round(1e9 / pairs_s, 1)
    results["waiters"] = depth
    print(json.dumps(results))


if __name__ == "__main__":
    main()
