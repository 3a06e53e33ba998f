"""User and system CPU per relayed request, slotgate beside bare uvicorn: where a request's
time goes that an instruction count does not see (the kernel's share, and code run slowly
because the caches were cold).

    python -m bench.experiments.user_system [--requests 5000] [--rounds 2]
        [--slotgate-tree DIR ...]

Starts the stand-in, then per round bench/floor.py's bare uvicorn answering every request
itself, bench/floor.py's uvicorn relaying every request to the stand-in with nothing else (the
floor under any relay uvicorn runs), then slotgate from each `--slotgate-tree` (default: this
checkout) on the like-for-like path (`STREAM_UPSTREAM=false`), one at a time. Each gets
1,000 requests to warm it, then `--requests` non-streamed chat requests one after the other on
one keep-alive connection, and the server process's user and system CPU over them is read from
`/proc/PID/stat`. A tick there is 10 ms: with the default 5,000 requests, about 1.5% of a
figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

from bench import contenders
from bench.loadgen import chat_body, connect, fetch, request_bytes
from bench.procs import Server
from bench.scenarios import CHAT

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS


async def _measure(server: Server, requests: int) -> tuple[float, float, float]:
    """User and system microseconds per request, and requests per second."""
    (exchange,) = await connect(server.port, 1)
    raw = request_bytes(server.port, CHAT, chat_body(stream=False))
    for _ in range(1000):
        await fetch(exchange, raw)
    pid = server.pids()[-1]
    loop = asyncio.get_running_loop()
    user, system = _cpu_s(pid)
    began = loop.time()
    for _ in range(requests):
        await fetch(exchange, raw)
    elapsed = loop.time() - began
    user_end, system_end = _cpu_s(pid)
    return (
        (user_end - user) / requests * 1e6,
        (system_end - system) / requests * 1e6,
        requests / elapsed,
    )


def _report(name: str, figures: tuple[float, float, float]) -> None:
    user, system, rate = figures
    print(f"{name}: user {user:.0f} us, system {system:.0f} us per request ({rate:.0f} req/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slotgate-tree", type=Path, action="append", default=[])
    args = parser.parse_args(argv)
    trees = args.slotgate_tree or [contenders.slotgate_tree]
    logs = Path(tempfile.mkdtemp(prefix="bench-user-system-"))
    standin = contenders.start_standin(logs)
    contenders.configure_standin(standin, slots=1024)
    try:
        for _ in range(args.rounds):
            for name, relay_to in (("bare uvicorn", None), ("uvicorn relaying", standin.port)):
                floor = contenders.start_floor(logs, answer=True, relay_to=relay_to)
                try:
                    _report(name, asyncio.run(_measure(floor, args.requests)))
                finally:
                    floor.stop()
            for tree in trees:
                contenders.slotgate_tree = tree
                gate = contenders.start_slotgate(
                    "slotgate", f"http://127.0.0.1:{standin.port}", logs,
                    {"STREAM_UPSTREAM": "false"},
                )  # fmt: skip
                try:
                    _report(f"slotgate from {tree}", asyncio.run(_measure(gate, args.requests)))
                finally:
                    gate.stop()
    finally:
        standin.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
