"""Where a waiting request's memory goes, line by line: slotgate's own share and uvicorn's.

    python -m bench.experiments.memtrace [--held 1000] [--app slotgate|floor] [--top 15] [--inner]
                                         [--stream]

Scenario 4 reads RSS, which says how much but not what. This runs uvicorn in this process,
configured as `slotgate` runs it (app/cli.py), with slotgate's app (one slot, held, and an
unbounded line) or bench/floor.py's holding app, under tracemalloc. A client in another
process (so that its own allocations stay out of the trace) opens `--held` requests that
wait (non-streamed, or streams with `--stream`); the allocations still alive after they all
wait, over those before, are charged to the innermost frame in slotgate's app/ when there is
one, else to the innermost frame at all. Printed per held request. `--inner` splits each line
of slotgate's by the innermost frame that allocated (a task's weak reference in asyncio's set
of tasks, say, under the line that made the task).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import linecache
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import slotgate
import uvicorn

from bench import floor
from bench.contenders import REPO, configure_standin, start_standin
from bench.loadgen import chat_body, request_bytes
from bench.loop import run_loop
from bench.procs import free_port, raise_fd_limit, wait_until
from bench.scenarios import CHAT

#: Where the slotgate being traced lives: the repository's app/, or wherever PYTHONPATH found
#: it (a tree measured through a `slotgate` link to its app/).
APP_DIR = os.path.dirname(slotgate.__file__) + os.sep


async def _client(port: int, count: int, path: str, stream: bool) -> None:
    """Open `count` requests to `path` and keep them open until stdin closes."""
    raw = request_bytes(port, path, chat_body(stream=stream))
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        writers.append(writer)
    print("sent", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def _open(
    port: int, count: int, path: str, stream: bool = False
) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.experiments.memtrace", "--client", str(port), str(count), path,
        "stream" if stream else "plain", stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert process.stdout is not None
    await process.stdout.readline()
    return process


async def _close(process: asyncio.subprocess.Process) -> None:
    assert process.stdin is not None
    process.stdin.close()
    await process.wait()


def _owner(trace: tracemalloc.Traceback) -> str:
    """slotgate's line when slotgate's code made the allocation, the library's otherwise.

    From the innermost frame out, the standard library's frames (asyncio making a task, say)
    act for their caller and are passed over; the first frame of slotgate's or of an installed
    package (uvicorn, even when called through slotgate's protocol subclass) owns it.
    """
    frames = list(trace)[::-1]  # most recent first
    for frame in frames:
        if frame.filename.startswith(APP_DIR):
            return f"slotgate app/{frame.filename.removeprefix(APP_DIR)}:{frame.lineno}"
        if "site-packages" + os.sep in frame.filename:
            break
    inner = frames[0]
    for marker in ("site-packages" + os.sep, "python3.11" + os.sep):
        if marker in inner.filename:
            return f"{inner.filename.split(marker)[-1]}:{inner.lineno}"
    return f"{inner.filename}:{inner.lineno}"


async def _trace(
    server: uvicorn.Server, held: int, waiting: Callable[[], int], *, hold_slot: bool, stream: bool
) -> Any:
    port = server.config.port
    await asyncio.to_thread(wait_until, lambda: server.started, 30, "uvicorn started")
    # slotgate's one slot taken, so that every later request waits in its line.
    holder = await _open(port, 1, CHAT + "?hang=1") if hold_slot else None
    await asyncio.sleep(0.5)
    # Every code path a waiter takes, warmed once: first-use caches are not a waiter's cost.
    warm = await _open(port, 100, CHAT, stream)
    await asyncio.to_thread(wait_until, lambda: waiting() == 100, 30, "100 waiting", 0.1)
    await _close(warm)
    await asyncio.to_thread(wait_until, lambda: waiting() == 0, 30, "none waiting", 0.1)
    gc.collect()
    tracemalloc.start(12)
    before = tracemalloc.take_snapshot()
    line = await _open(port, held, CHAT, stream)
    await asyncio.to_thread(wait_until, lambda: waiting() == held, 120, "all waiting", 0.1)
    await asyncio.sleep(0.3)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    await _close(line)
    if holder is not None:
        await _close(holder)
    server.should_exit = True
    return after.compare_to(before, "traceback")


def floor_held() -> int:
    return floor.held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, default=1000)
    parser.add_argument("--app", choices=("slotgate", "floor"), default="slotgate")
    parser.add_argument("--top", type=int, default=15, help="lines shown per owner")
    parser.add_argument(
        "--inner", action="store_true", help="split slotgate's lines by the innermost frame"
    )
    parser.add_argument("--stream", action="store_true", help="the waiters ask for streams")
    parser.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        port, count, path, kind = args.client
        run_loop(_client(int(port), int(count), path, kind == "stream"))
        return 0
    raise_fd_limit()
    logs = REPO / "bench" / "results" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    standin = start_standin(logs)
    try:
        configure_standin(standin, slots=1)
        stats = _run(args.app, standin.port, args.held, args.stream)
    finally:
        standin.stop()
    _print(stats, args.held, args.top, inner=args.inner)
    return 0


def _run(app_name: str, upstream: int, held: int, stream: bool) -> Any:
    from slotgate.cli import uvicorn_config
    from slotgate.main import create_app
    from slotgate.settings import Settings

    settings = Settings(
        llama_server_url=f"http://127.0.0.1:{upstream}", port=free_port(), max_queue=0,
        log_level="warning",
    )  # fmt: skip
    if app_name == "floor":
        app: Callable[..., Any] = floor.hold
        waiting: Callable[[], int] = floor_held
    else:
        gateway = create_app(settings)
        app, admission = gateway, gateway.state.service.admission
        waiting = lambda: admission.snapshot().queued  # noqa: E731
    server = uvicorn.Server(uvicorn_config(app, settings))

    async def both() -> Any:
        serving = asyncio.ensure_future(server.serve())
        try:
            return await _trace(
                server, held, waiting, hold_slot=app_name == "slotgate", stream=stream
            )
        finally:
            server.should_exit = True
            await serving

    return run_loop(both())


def _print(
    stats: list[tracemalloc.StatisticDiff], held: int, top: int, *, inner: bool = False
) -> None:
    size: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    within: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    for stat in stats:
        owner = _owner(stat.traceback)
        size[owner] += stat.size_diff
        count[owner] += stat.count_diff
        frame = stat.traceback[-1]  # the innermost
        within[owner][f"{Path(frame.filename).name}:{frame.lineno}"] += stat.size_diff
    own = sum(v for k, v in size.items() if k.startswith("slotgate "))
    total = sum(size.values())
    print(f"per held request ({held}): {total / held:,.0f} B traced in all, "
          f"{own / held:,.0f} B where slotgate's code allocated, "
          f"{(total - own) / held:,.0f} B elsewhere (uvicorn, asyncio, uvloop)")  # fmt: skip
    for mine in (True, False):
        print("\nslotgate's lines" if mine else "\nthe rest")
        rows = [(k, v) for k, v in size.most_common() if k.startswith("slotgate ") == mine]
        for key, value in rows[:top]:
            print(f"  {value / held:7,.0f} B  {count[key] / held:5.2f} objects  {key}  "
                  f"{_source(key)}")  # fmt: skip
            if inner and mine:
                for site, part in within[key].most_common():
                    if round(part / held):
                        print(f"  {'':9}{part / held:7,.0f} B  in {site}")


def _source(owner: str) -> str:
    path, _, line = owner.split(" ")[-1].rpartition(":")
    mine = Path(APP_DIR) / path.removeprefix("app/")
    for candidate in (mine, REPO / path, *(Path(p) / path for p in sys.path if p)):
        if candidate.is_file():
            return linecache.getline(str(candidate), int(line)).strip()[:70]
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
