"""What routing among upstreams costs the admission core itself (issue 18's CPU target):
an enter and a release, with and without an affinity key, over one pool of 64 slots and over
8 pools of 8, nothing waiting.

    python -m bench.experiments.routing_cost [--n 100000]

Measured at f7b82bc: 1.6-2.3 us without a key over one pool, 4.7-5.6 us over 8; 1.6-2.0 and
7.6-8.1 us with a key. `python -m bench --scenarios fleet-cost` finds 20-35 us more per request
over 8 upstreams than over one, in a closed loop whose throughput is 5-15% lower over 8: the core
explains 3-6 us of it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy


async def per_request_us(pools: int, keyed: bool, n: int) -> float:
    admission = Admission(QueuePolicy())
    for index in range(pools):
        admission.add_pool(f"http://10.0.0.{index + 1}:8080").resize(64 // pools)
    start = time.perf_counter()
    for i in range(n):
        ticket = admission.enter(affinity=(i * 2654435761) % 2**64 if keyed else None)
        ticket.release()
    return (time.perf_counter() - start) / n * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    args = parser.parse_args()
    for keyed in (False, True):
        one = await per_request_us(1, keyed, args.n)
        eight = await per_request_us(8, keyed, args.n)
        print(f"{'keyed' if keyed else 'no key'}: 1 pool {one:.2f} us, 8 pools {eight:.2f} us")


if __name__ == "__main__":
    asyncio.run(main())
