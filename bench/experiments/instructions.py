"""Instructions per relayed request, counted by valgrind's callgrind: a figure the machine's
load does not move, where CPU timings on a shared machine are noise.

    python -m bench.experiments.instructions [--concurrency 32] [--seconds 30] [--warm-s 8]
        [--slotgate-tree DIR] [--env KEY=VALUE ...] [--cache-sim] [--floor | --relay-floor]

Starts the stand-in and slotgate (`STREAM_UPSTREAM=false`, one upstream of 1,024 slots, no
tenants, no budget, no Redis: the like-for-like path) with slotgate under
`valgrind --tool=callgrind --instr-atstart=no`, warms it with wrk, counts for `--seconds` of
wrk load at `--concurrency` connections (instrumentation on through `callgrind_control`), and
divides the instructions counted by the requests wrk completed. Also prints the calls to
CPython's generic attribute lookup (`PyObject_GetAttr`, what a load the interpreter could not
specialize costs) and to its allocator, per request. Needs valgrind and wrk (Debian packages).

With `--floor`, the same count of bench/floor.py's bare uvicorn answering every request itself
(scenario 1's `uvicorn-bare`): the floor slotgate's count is compared with, which the CPU
target's "times bare uvicorn" compares in CPU time. With `--relay-floor`, the count of
bench/floor.py's uvicorn relaying every request to the stand-in with nothing else (scenario 1's
`uvicorn-relay`): the floor under any relay that uvicorn runs.

With `--cache-sim`, callgrind also simulates the caches (its model: first-level instruction
and data caches and the last level, of this machine's sizes) and prints their misses per
request: what fewer instructions can still lose to a bigger footprint. It sees one process's
accesses only, not the evictions by the kernel and the other processes between two requests.

User-space instructions only: system calls count as the instructions that make them. Under
valgrind slotgate runs some fifty times slower, so a timer shorter than a request's time
there fires where it would not at full speed (789b84c's 20 ms client-gone timer does at 32
connections, adding a task step per request to its count): compare trees at
`--concurrency 1` as well.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import contenders, loadgen
from bench.contenders import configure_standin, start_standin
from bench.loadgen import wait_http
from bench.procs import free_port, spawn
from bench.scenarios import CHAT

#: The calls callgrind's output names, counted per request.
_CALLS = ("PyObject_GetAttr", "_PyObject_Malloc")
#: The simulated caches' misses (`--cache-sim`), by callgrind's event names: first-level
#: instruction and data (reads and writes), and the last level's for all three.
_MISSES = {"I1mr": "I1", "D1mr": "D1 read", "D1mw": "D1 write"}
_LAST_LEVEL = ("ILmr", "DLmr", "DLmw")


def _calls(profile: Path) -> collections.Counter[str]:
    """Calls to each function named in a callgrind profile (its `calls=` lines, summed)."""
    names: dict[str, str] = {}
    counts: collections.Counter[str] = collections.Counter()
    callee = None
    for line in profile.read_text(errors="replace").splitlines():
        if line.startswith(("fn=", "cfn=")):
            key, _, rest = line.partition("=")
            found = re.match(r"\((\d+)\)(?: (.*))?", rest.strip())
            if found is None:
                continue
            if found.group(2):
                names[found.group(1)] = found.group(2)
            if key == "cfn":
                callee = found.group(1)
        elif line.startswith("calls=") and callee is not None:
            counts[names.get(callee, callee)] += int(line.split("=")[1].split()[0])
    return counts


def _control(pid: int, prefix: Path, switch: str, env: dict[str, str]) -> None:
    # vgdb finds the process by a FIFO named after the process's USER and HOST variables.
    subprocess.run(
        ["callgrind_control", f"--vgdb-prefix={prefix}", "-i", switch, str(pid)],
        check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _floor(args: argparse.Namespace, upstream_port: int, port: int) -> list[str]:
    """bench/floor.py's command line when a floor is counted instead of slotgate."""
    if args.relay_floor:
        return ["bench.floor", "--relay", str(upstream_port), "--port", str(port)]
    if args.floor:
        return ["bench.floor", "--answer", "--port", str(port)]
    return []


def measure(args: argparse.Namespace) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    # vgdb's FIFOs need a file system that takes them (a bind-mounted work tree may not): a
    # private folder in /dev/shm where there is one.
    shm = Path("/dev/shm")  # noqa: S108 - a folder of its own is made in it, mode 0700
    prefix = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None)) / "vgdb"
    standin = start_standin(work)
    configure_standin(standin, tokens=16, token_delay_s=0, hold_s=0, record_gaps=False)
    port = free_port()
    profile = work / "callgrind.out"
    env = {
        **os.environ,
        "LLAMA_SERVER_URL": f"http://127.0.0.1:{standin.port}",
        "PORT": str(port),
        "HOST": "127.0.0.1",
        "LOG_LEVEL": "warning",
        "STREAM_UPSTREAM": "false",
        # Nothing is in flight at the stop: a short drain, so the profile is written in time.
        "DRAIN_TIMEOUT_S": "1",
        "PYTHONPATH": str(contenders.slotgate_tree),
        "USER": os.environ.get("USER", "slotgate"),
        **dict(item.split("=", 1) for item in args.env),
    }
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", "--vgdb=yes",
        f"--vgdb-prefix={prefix}", f"--callgrind-out-file={profile}",
        *(["--cache-sim=yes"] if args.cache_sim else []),
        sys.executable, "-m",
        *(_floor(args, standin.port, port) or ["slotgate"]),
    ]  # fmt: skip
    # The floor is run from the checkout (it imports the stand-in's answer from tests/).
    cwd = contenders.REPO if args.floor or args.relay_floor else work
    gate = spawn("slotgate", command, port, None, work, env=env, cwd=cwd)
    try:
        wait_http(port, "/readyz", 300, lambda status: status == 200)
        body = loadgen.chat_body(stream=False)
        loadgen.wrk(port, CHAT, body, args.concurrency, args.warm_s)
        _control(gate.process.pid, prefix, "on", env)
        result = loadgen.wrk(port, CHAT, body, args.concurrency, args.seconds)
        _control(gate.process.pid, prefix, "off", env)
    finally:
        gate.stop()
        standin.stop()
    deadline = time.monotonic() + 60
    while not profile.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    requests = int(result["requests"])
    text = profile.read_text(errors="replace")
    events = re.search(r"^events: (.+)$", text, re.M)
    totals = re.search(r"^totals: (.+)$", text, re.M)
    if events is None or totals is None or not requests:
        raise SystemExit(f"no count: see the logs in {work}")
    counted = dict(zip(events.group(1).split(), map(int, totals.group(1).split()), strict=True))
    calls = _calls(profile)
    figures = {"requests": float(requests), "instructions": counted["Ir"] / requests}
    figures.update({name: calls[name] / requests for name in _CALLS})
    if args.cache_sim:
        figures.update({label: counted[event] / requests for event, label in _MISSES.items()})
        figures["last level"] = sum(counted[event] for event in _LAST_LEVEL) / requests
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0, help="counted")
    parser.add_argument("--warm-s", type=float, default=8.0)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--floor", action="store_true", help="count bare uvicorn instead")
    parser.add_argument(
        "--relay-floor",
        action="store_true",
        help="count uvicorn relaying with nothing else (bench/floor.py --relay) instead",
    )
    parser.add_argument("--cache-sim", action="store_true", help="count simulated cache misses")
    parser.add_argument(
        "--slotgate-tree", type=Path, help="a folder holding a slotgate/ package (another tree)"
    )
    args = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench.experiments.instructions: {tool} is not installed")
    if args.slotgate_tree is not None:
        contenders.slotgate_tree = args.slotgate_tree.resolve()
    figures = measure(args)
    print(
        (
            "uvicorn relaying (bench/floor.py --relay)"
            if args.relay_floor
            else "bare uvicorn (bench/floor.py --answer)"
            if args.floor
            else f"slotgate from {contenders.slotgate_tree}"
        )
        + f", {args.concurrency} connections: "
        f"{figures['requests']:.0f} requests counted; per request "
        f"{figures['instructions'] / 1000:.1f} k instructions, "
        + ", ".join(f"{figures[name]:.1f} calls to {name}" for name in _CALLS)
    )
    if args.cache_sim:
        labels = [*_MISSES.values(), "last level"]
        print(
            "cache misses per request: "
            + ", ".join(f"{label} {figures[label]:.0f}" for label in labels)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
