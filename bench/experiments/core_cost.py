"""What the admission core costs on its hot path, one pool and no tenants, in two trees side by
side: an enter and a release with nothing waiting, and an enter into the line followed by the
hand-off of the slot to it (and, for comparison, an enter and a release over 8 pools). Rounds
are interleaved in one process, so a loaded machine slows both alike; compare the best of
each.

Measured on fix/weights against its base (0884058), 2 cores under a load of about 5, best of
250 rounds of 3000 (`--rounds 250 --n 3000`): enter+release 1.48-1.50 us in the base, 1.41-1.42
us on the branch; line+hand-off 2.35-2.37 us against 2.24-2.29 us. Over 8 pools (a fleet, not
this hot path) 4.67 us against 4.77 us: one more call to route among a subset of the pools.

    git archive BASE app | tar -x -C /tmp/base
    python -m bench.experiments.core_cost /tmp/base/app app [--rounds 80] [--n 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType


def load(name: str, path: str) -> ModuleType:
    """The admission module of the package at `path`, imported as `name`."""
    spec = importlib.util.spec_from_file_location(
        name, f"{path}/__init__.py", submodule_search_locations=[path]
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a package")
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.admission")


def free_us(core: ModuleType, n: int) -> float:
    admission = core.Admission(capacity=64)
    start = time.perf_counter()
    for _ in range(n):
        admission.enter().release()
    return (time.perf_counter() - start) / n * 1e6


def fleet_us(core: ModuleType, n: int) -> float:
    """enter+release over 8 pools of 8 slots, without a key (for comparison: not the hot
    path of one pool)."""
    admission = core.Admission()
    for index in range(8):
        admission.add_pool(f"http://10.0.0.{index + 1}:8080").resize(8)
    start = time.perf_counter()
    for _ in range(n):
        admission.enter().release()
    return (time.perf_counter() - start) / n * 1e6


def handoff_us(core: ModuleType, n: int) -> float:
    admission = core.Admission(capacity=1)
    holder = admission.enter()
    start = time.perf_counter()
    for _ in range(n):
        waiter = admission.enter()  # a place in the line (a future, never awaited)
        holder.release()  # hands the slot to it
        holder = waiter
    return (time.perf_counter() - start) / n * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("tree")
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--n", type=int, default=5_000)
    args = parser.parse_args()
    cores = {"base": load("core_base", args.base), "tree": load("core_tree", args.tree)}
    cases: dict[str, Callable[[ModuleType, int], float]] = {
        "enter+release": free_us,
        "line+hand-off": handoff_us,
        "8 pools": fleet_us,
    }
    seen: dict[tuple[str, str], list[float]] = {(c, k): [] for c in cases for k in cores}
    for _ in range(args.rounds):
        for case, measure in cases.items():
            for key, core in cores.items():
                seen[(case, key)].append(measure(core, args.n))
    for (case, key), values in seen.items():
        best, median = min(values), statistics.median(values)
        print(f"{case:14} {key:5} best {best:.2f} us, median {median:.2f} us")


if __name__ == "__main__":
    asyncio.run(main())  # a waiter's future needs a running loop
