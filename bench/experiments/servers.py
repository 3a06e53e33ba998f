"""The ASGI server under slotgate, measured against the alternative: uvicorn and granian.

    python -m bench.experiments.servers [--duration-s 5] [--held 5000] [--runs 2] [--no-install]

Issue 6 asks that a dependency found to be the bottleneck be measured against its alternatives
side by side. uvicorn is the floor under two of slotgate's figures (CPU per request, memory per
waiting request), so each server runs, pinned to the server core in front of the stand-in:
- the floor (bench/floor.py's apps, nothing a gate does) and slotgate itself;
- non-streamed chat completions at concurrency 32: requests/s (slotgate with
  `STREAM_UPSTREAM=false`, so the figure is the relay's and the server's);
- memory per held request with `--held` requests open: the floor holds them, slotgate keeps
  them waiting in its line.

granian (Rust HTTP, ASGI) runs as slotgate would run on it: one worker, one runtime thread,
uvloop. It is pip-installed into the running environment when missing, unless --no-install.
Prints a table and writes bench/results/servers.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.contenders import (
    BENCH,
    REPO,
    await_ready,
    configure_standin,
    start_floor,
    start_slotgate,
    start_standin,
)
from bench.loadgen import chat_body, closed_loop, request_bytes
from bench.loop import run_loop
from bench.procs import SERVER_CORE, Server, free_port, raise_fd_limit, spawn
from bench.scenarios import CHAT, fill_line, held_by_floor, hold, pool, release

SERVERS = ("uvicorn", "granian")


def _granian(logs: Path, target: str, *, factory: bool, env: dict[str, str]) -> Server:
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("granian")), "--interface", "asgi",
        "--loop", "uvloop", "--workers", "1", "--runtime-threads", "1", "--runtime-mode", "st",
        "--http", "1", "--no-ws", "--backlog", "4096", "--log-level", "warning",
        # granian serves at most `backpressure` requests at once (default: the backlog); the
        # held requests would shut the readiness probe out.
        "--backpressure", "65536",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if factory:
        command.append("--factory")
    command.append(target)
    name = f"granian-{target.split(':')[1]}"
    values = {"PYTHONPATH": str(REPO), **env}
    return await_ready(spawn(name, command, port, SERVER_CORE, logs, env=values, cwd=logs),
                       "/readyz", 30)  # fmt: skip


def _start(server: str, app: str, standin: Server, logs: Path, *, answer: bool) -> Server:
    """One server running the floor (answering or holding) or slotgate, ready."""
    url = f"http://127.0.0.1:{standin.port}"
    # Holding: one slot, held by the caller, and an unbounded line; answering: nobody waits.
    env = {"LLAMA_SERVER_URL": url, "LOG_LEVEL": "warning", "STREAM_UPSTREAM": "false"}
    if not answer:
        env["MAX_QUEUE"] = "0"
    configure_standin(standin, slots=1024 if answer else 1, tokens=16, token_delay_s=0)
    if server == "uvicorn":
        if app == "floor":
            return start_floor(logs, answer=answer)
        return start_slotgate("slotgate", url, logs, env)
    if app == "floor":
        return _granian(logs, f"bench.floor:{'answer' if answer else 'hold'}", factory=False,
                        env={})  # fmt: skip
    return _granian(logs, "slotgate.main:create_app", factory=True, env=env)


def _rps(server: Server, duration_s: float) -> float:
    body = chat_body(stream=False)
    raw = request_bytes(server.port, CHAT, body)
    run_loop(closed_loop(server.port, raw, 32, 1.0))
    if loadgen.wrk_available():
        result = loadgen.wrk(server.port, CHAT, body, 32, duration_s)
        return float(result["requests"]) / (result["duration_us"] / 1e6)
    stats = run_loop(closed_loop(server.port, raw, 32, duration_s))
    return stats.rate


def _kb_per_held(server: Server, app: str, held: int) -> float:
    def holding(n: int) -> bool:
        if app == "floor":
            return held_by_floor(server) == n
        return bool(pool(server)["queued"] == n)

    async def run() -> dict[str, Any]:
        holder = await hold(server.port, 1, CHAT + "?hang=1") if app == "slotgate" else []
        try:
            return await fill_line(server, held, holding)
        finally:
            release(holder)

    return float(run_loop(run())["kb_per_waiter"])


def measure(
    standin: Server, logs: Path, runs: int, duration_s: float, held: int
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for server_name in SERVERS:
        for app in ("floor", "slotgate"):
            row: dict[str, Any] = {"rps_c32": [], "kb_per_held": None}
            for _ in range(runs):
                server = _start(server_name, app, standin, logs, answer=True)
                try:
                    row["rps_c32"].append(round(_rps(server, duration_s)))
                finally:
                    server.stop()
            server = _start(server_name, app, standin, logs, answer=False)
            try:
                row["kb_per_held"] = round(_kb_per_held(server, app, held), 2)
            finally:
                server.stop()
            results[f"{server_name} {app}"] = row
            print(f"bench.servers: {server_name} {app}: {row}", flush=True)
    return results


def _install_granian() -> bool:
    if importlib.util.find_spec("granian") is None:
        print("bench.servers: pip install granian", flush=True)
        command = [sys.executable, "-m", "pip", "install", "-q", "granian"]
        subprocess.run(command, check=False, timeout=900)
        importlib.invalidate_caches()
    return importlib.util.find_spec("granian") is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--held", type=int, default=5000, help="requests held for memory")
    parser.add_argument("--runs", type=int, default=2, help="throughput runs per server and app")
    parser.add_argument("--no-install", action="store_true")
    args = parser.parse_args(argv)
    if args.no_install and importlib.util.find_spec("granian") is None:
        print("bench.servers: granian is not installed (--no-install)", file=sys.stderr)
        return 2
    if not args.no_install and not _install_granian():
        print("bench.servers: granian could not be installed", file=sys.stderr)
        return 2
    raise_fd_limit()
    results_dir = BENCH / "results"
    logs = results_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    standin = start_standin(logs)
    try:
        results = measure(standin, logs, args.runs, args.duration_s, args.held)
    finally:
        standin.stop()
    version = _version("granian")
    print(f"\n| server, app | req/s at c=32 (each run) | KB per held request ({args.held}) |")
    print("|---|---|---|")
    for name, row in results.items():
        rps = " / ".join(f"{value:,}" for value in row["rps_c32"])
        print(f"| {name} | {rps} | {row['kb_per_held']} |")
    report = {
        "command": "python -m bench.experiments.servers " + " ".join(argv or sys.argv[1:]),
        "seconds": round(time.monotonic() - started),
        "versions": {"uvicorn": _version("uvicorn"), "granian": version},
        "held": args.held,
        "results": results,
    }
    (results_dir / "servers.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    raise SystemExit(main())
