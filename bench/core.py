"""Scenario 5: slotgate's admission core alone, in-process, in pairs per second.

What "a pair at line depth D" means, for a FIFO where nobody overtakes:

- `fast`: the line is empty and a slot is free: `enter()` admits at once, `release()` frees.
  This only exists at depth 0: with anyone waiting, a newcomer must join the line.
- `handoff`: one slot, held; D waiters in line. Each pair is what a full pool does all day:
  a newcomer `enter()`s at the back, the holder `release()`s, the slot goes straight to the
  head of the line, and the head's `wait()` returns (admitted). The depth stays D.
- `churn`: one slot, held; D waiters in line. A newcomer `enter()`s at the back and gives up
  (`release()` of a waiting ticket): the cost of a client that leaves a deep line.

The core is flat when `handoff` and `churn` at depth 10,000 match their depth-0 figures.
Run as `python -m bench.core --pairs N --depth D`; prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.ticket import Ticket

from bench.loop import run_loop


def _unbounded() -> Admission:
    return Admission(QueuePolicy(max_queue=0), capacity=1)


async def fast(pairs: int) -> float:
    admission = _unbounded()
    started = time.perf_counter()
    for _ in range(pairs):
        admission.enter().release()
    return pairs / (time.perf_counter() - started)


async def handoff(pairs: int, depth: int) -> float:
    admission = _unbounded()
    holder = admission.enter()
    line: collections.deque[Ticket] = collections.deque(admission.enter() for _ in range(depth))
    assert admission.queued == depth
    started = time.perf_counter()
    for _ in range(pairs):
        line.append(admission.enter())
        holder.release()
        holder = line.popleft()
        await holder.wait()
    elapsed = time.perf_counter() - started
    assert holder.admitted
    assert admission.queued == depth
    assert admission.active == 1
    return pairs / elapsed


async def churn(pairs: int, depth: int) -> float:
    admission = _unbounded()
    admission.enter()
    for _ in range(depth):
        admission.enter()
    started = time.perf_counter()
    for _ in range(pairs):
        admission.enter().release()
    elapsed = time.perf_counter() - started
    assert admission.queued == depth
    return pairs / elapsed


async def measure(pairs: int, depth: int, repeats: int) -> dict[str, float]:
    """Best of `repeats` for each figure: the least disturbed run shows the core's own cost."""
    runs: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(repeats):
        runs["fast_depth_0"].append(await fast(pairs))
        runs["handoff_depth_0"].append(await handoff(pairs, 0))
        runs[f"handoff_depth_{depth}"].append(await handoff(pairs, depth))
        runs["churn_depth_0"].append(await churn(pairs, 0))
        runs[f"churn_depth_{depth}"].append(await churn(pairs, depth))
    return {name: round(max(values)) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=300_000)
    parser.add_argument("--depth", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run_loop(measure(args.pairs, args.depth, args.repeats))))


if __name__ == "__main__":
    main()
