"""The fair line's own cost per waiter, beside the plain FIFO deque it would replace.

    python -m bench.experiments.fairline [--ops 200000] [--waiters 10000] [--tenants 1000]

Issue 19: the ordering core must stay O(log tenants) or better per operation at 10,000
waiters and 1,000 tenants, and the one-tenant case must not cost the admission core more than
10%. Each figure is nanoseconds per pair at a steady depth (best of `--repeats`), one process,
no event loop running (the futures are real asyncio futures, never awaited):

- `deque`: today's line: `append` at the back; the head's `future.done()` read, `popleft`.
- `push+pop`: `FairLine.push` and `head` + `pop_head`.
- `cycle`: the same plus `granted` and `released` of the ticket popped, as each grant does.
- `core_1_tenant` / `core_N_tenants`: the whole admission core per request at the same depth,
  one slot held: a newcomer enters, the holder releases, the slot goes to the next waiter (by
  the plain line with one tenant, by the fair line with N), whose wait returns. Both run the
  same harness (a done-callback per waiter finds who was granted), so the difference between
  them is the fair line's; `bench.core` measures the one-tenant core without that harness.

Times are CPU time of this process (`time.process_time`), so that other processes on a busy
machine do not count; best of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from collections.abc import Callable
from functools import partial

from slotgate.admission import Admission, QueuePolicy
from slotgate.admission import Ticket as CoreTicket
from slotgate.fairline import FairLine
from slotgate.tenants import Tenant

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
    started = time.process_time_ns()
    for ticket in tickets[depth:]:
        line.append(ticket)
        future = line[0]._future
        if future is not None and future.done():
            raise AssertionError
        line.popleft()
    return (time.process_time_ns() - started) / (len(tickets) - depth)


def fair_pairs(tickets: list[Ticket], depth: int, cycle: bool) -> float:
    line: FairLine[Ticket] = FairLine()
    for ticket in tickets[:depth]:
        line.push(ticket)
    started = time.process_time_ns()
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
    elapsed = time.process_time_ns() - started
    assert len(line) == depth
    return elapsed / (len(tickets) - depth)


async def core_pairs(tenants: int, depth: int, pairs: int) -> float:
    """ns per request through the admission core at `depth` waiters of `tenants` tenants."""
    admission = Admission(QueuePolicy(max_queue=0), capacity=1)
    names = [Tenant(f"t{n}", weight=1 + n % 3) for n in range(tenants)]
    granted: collections.deque[CoreTicket] = collections.deque()

    def enter(n: int) -> CoreTicket:
        ticket = admission.enter(tenant=names[n % tenants])
        future = ticket._future
        if future is not None:
            future.add_done_callback(lambda _, t=ticket: granted.append(t))
        return ticket

    holder = enter(0)
    for n in range(depth):
        enter(n + 1)
    assert admission.queued == depth
    started = time.process_time_ns()
    for n in range(pairs):
        enter(n)
        holder.release()
        await asyncio.sleep(0)
        holder = granted.popleft()
        await holder.wait()
    elapsed = time.process_time_ns() - started
    assert admission.queued == depth
    assert (admission._fair is None) == (tenants == 1)
    return elapsed / pairs


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
    for tenants in (1, args.tenants):
        runs = [run_loop(core_pairs(tenants, depth, ops // 4)) for _ in range(repeats)]
        label = f"{tenants}_tenant{'s' if tenants > 1 else ''}"
        results[f"core_{label}_ns"] = round(min(runs), 1)
    results["waiters"] = depth
    print(json.dumps(results))


if __name__ == "__main__":
    main()
