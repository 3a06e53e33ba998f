"""The fair line's own cost per waiter, beside the plain FIFO deque it would replace.

    python -m bench.experiments.fairline [--ops 200000] [--waiters 10000] [--tenants 1000]
    python -m bench.experiments.fairline --against DIR [--pairs 20000] [--rounds 15]

`--against DIR` compares the one-tenant admission core with another commit's instead: DIR
holds that commit's package as `DIR/app` (`git archive main app | tar -x -C DIR`); both run in
this process, in alternating rounds, per pair of `bench.core`'s kinds (fast: enter + release
with nobody waiting; handoff at depth 0 and at `--waiters`; churn: a waiter that gives up).

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
import importlib
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from slotgate.gate.admission import Admission
from slotgate.gate.fairline import FairLine
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.tenants import Tenant
from slotgate.gate.ticket import Ticket as CoreTicket

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
    assert isinstance(admission._line, FairLine) == (tenants > 1)
    return elapsed / pairs


def other_core(folder: str) -> Any:
    """The admission module of the slotgate copy in `folder`/app, imported as `slotother`."""
    init = Path(folder) / "app" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "slotother", init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None
    assert spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["slotother"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("slotother.admission")


async def core_kinds(core: Any, pairs: int, depth: int) -> dict[str, float]:
    """ns per pair of each of bench.core's kinds, for the admission module `core`."""

    def fresh() -> Any:
        return core.Admission(core.QueuePolicy(max_queue=0), capacity=1)

    figures: dict[str, float] = {}
    admission = fresh()
    started = time.process_time_ns()
    for _ in range(pairs):
        admission.enter().release()
    figures["fast"] = (time.process_time_ns() - started) / pairs
    for level in (0, depth):
        admission = fresh()
        holder = admission.enter()
        line = collections.deque(admission.enter() for _ in range(level))
        started = time.process_time_ns()
        for _ in range(pairs):
            line.append(admission.enter())
            holder.release()
            holder = line.popleft()
            await holder.wait()
        figures[f"handoff_{level}"] = (time.process_time_ns() - started) / pairs
    admission = fresh()
    admission.enter()
    for _ in range(depth):
        admission.enter()
    started = time.process_time_ns()
    for _ in range(pairs):
        admission.enter().release()
    figures[f"churn_{depth}"] = (time.process_time_ns() - started) / pairs
    return figures


async def against(folder: str, pairs: int, depth: int, rounds: int) -> dict[str, Any]:
    import slotgate.gate.admission as ours

    theirs = other_core(folder)
    runs: dict[str, list[dict[str, float]]] = {"this": [], "other": []}
    for n in range(rounds):
        order = [("this", ours), ("other", theirs)]
        for name, core in order if n % 2 else order[::-1]:
            runs[name].append(await core_kinds(core, pairs, depth))
    result: dict[str, Any] = {}
    for kind in runs["this"][0]:
        this = min(run[kind] for run in runs["this"])
        other = min(run[kind] for run in runs["other"])
        result[kind] = {
            "this_ns": round(this),
            "other_ns": round(other),
            "change_pct": round(100 * (this / other - 1), 1),
        }
    return result


def best(repeats: int, measure: Callable[[], float]) -> float:
    return round(min(measure() for _ in range(repeats)), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000)
    parser.add_argument("--waiters", type=int, default=10_000)
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", metavar="DIR")
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.against:
        print(json.dumps(run_loop(against(args.against, args.pairs, args.waiters, args.rounds))))
        return
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
