"""What the experiments start: the stand-in or hostile upstream, and slotgate, on loopback.

slotgate runs as `python -m slotgate` (`start_gate`) or, where an experiment reads its event
loop or patches it, in the experiment's own loop (`serve`). Every process goes to a free
port on 127.0.0.1, logs into bench/results/logs/ and is stopped by the experiment that
started it. `--pythonpath DIR` puts another slotgate first on the
import path (DIR holds a `slotgate/` package, for instance an older app/ extracted with
`git archive COMMIT app | tar -x -C DIR && mv DIR/app DIR/slotgate`), to measure before and
after a change with the same experiment; in-process experiments run themselves again with
DIR on PYTHONPATH (`reexec_with`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from bench.contenders import BENCH, REPO, await_ready, start_slotgate
from bench.procs import CLIENT_CORE, SERVER_CORE, Server, free_port, spawn

LOGS = BENCH / "results" / "logs"

#: tests/support/standin.py run on its own as llama-server behaves (stream connections closed, plain
#: token contents) rather than with the benchmark's settings.
_LIKE_LLAMA_SERVER = {"close_after_stream": True, "stamps": False}


def _alive(start: Callable[[], Server]) -> Server:
    """`start()`, again if the process it started has died: free_port() can race with other
    programs on the machine, and then the readiness probe may have reached another server."""
    for _ in range(3):
        server = start()
        time.sleep(0.3)
        if server.alive():
            return server
        server.stop()
    raise RuntimeError(f"{server.name} exited at start:\n{server.tail()}")


def logs() -> Path:
    LOGS.mkdir(parents=True, exist_ok=True)
    return LOGS


def start_standin(**knobs: object) -> Server:
    """The stand-in (tests/support/standin.py) with these knobs (total_slots, tokens, ...)."""
    import json

    def start() -> Server:
        port = free_port()
        values = json.dumps({**_LIKE_LLAMA_SERVER, **knobs})
        command = [
            sys.executable,
            "-m",
            "tests.support.standin",
            "--port",
            str(port),
            "--knobs",
            values,
        ]
        server = spawn("standin", command, port, CLIENT_CORE, logs(), cwd=REPO)
        return await_ready(server, "/props", 30)

    return _alive(start)


def start_hostile(answer: str, total_slots: int = 1, hold_s: float = 1.0) -> Server:
    """The hostile stand-in misbehaving as `answer`; a target ending in ?hold streams."""

    def start() -> Server:
        port = free_port()
        command = [
            sys.executable, "-m", "tests.support.hostile", "--port", str(port), "--answer", answer,
            "--total-slots", str(total_slots), "--hold-s", str(hold_s),
        ]  # fmt: skip
        server = spawn("hostile", command, port, CLIENT_CORE, logs(), cwd=REPO)
        return await_ready(server, "/props", 30)

    return _alive(start)


def start_gate(
    upstream_url: str, env: dict[str, str] | None = None, pythonpath: str | None = None
) -> Server:
    """`python -m slotgate` in front of `upstream_url`, ready; `pythonpath` runs other code."""
    values = dict(env or {})
    if pythonpath:
        values["PYTHONPATH"] = pythonpath
    return _alive(lambda: start_slotgate("slotgate", upstream_url, logs(), values, SERVER_CORE))


async def serve(upstream_url: str, **values: Any) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """slotgate in this loop on a free port, configured as `slotgate` runs it (when it can)."""
    from slotgate.main import create_app
    from slotgate.settings import Settings

    known = {key: value for key, value in values.items() if key in Settings.model_fields}
    settings = Settings(
        _env_file=None, llama_server_url=upstream_url, host="127.0.0.1", port=0,
        log_level="warning", **known,
    )  # fmt: skip
    app = create_app(settings)
    try:
        from slotgate.cli import uvicorn_config

        config = uvicorn_config(app, settings)
    except ImportError:  # an older slotgate: uvicorn as it used to run it
        config = uvicorn.Config(app, host="127.0.0.1", port=0, loop="uvloop", lifespan="on")
    config.log_level = "warning"
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
        await asyncio.sleep(0.01)
    return server, task


def port_of(server: uvicorn.Server) -> int:
    return int(server.servers[0].sockets[0].getsockname()[1])


def reexec_with(pythonpath: str | None, module: str) -> None:
    """Run this experiment again with `pythonpath` first on the import path (in-process ones)."""
    if not pythonpath or os.environ.get("SLOTGATE_EXPERIMENT_PYTHONPATH") == pythonpath:
        return
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")])),
        "SLOTGATE_EXPERIMENT_PYTHONPATH": pythonpath,
    }
    os.chdir(REPO)
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)  # noqa: S606


def slotgate_origin() -> str:
    """Where the imported slotgate comes from, to print with the figures."""
    import slotgate

    return str(Path(slotgate.__file__).parent)


def env_pairs(pairs: list[str]) -> dict[str, str]:
    """`KEY=VALUE` arguments as a dict."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--env wants KEY=VALUE, got {pair!r}")
        values[key] = value
    return values
