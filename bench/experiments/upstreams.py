"""What the experiments start: the stand-in or hostile upstream, and slotgate, on loopback.

Every process goes to a free port on 127.0.0.1, logs into bench/results/logs/ and is stopped
by the experiment that started it. `--pythonpath DIR` puts another slotgate first on the
import path (DIR holds a `slotgate/` package, for instance an older app/ extracted with
`git archive COMMIT app | tar -x -C DIR && mv DIR/app DIR/slotgate`), to measure before and
after a change with the same experiment.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.contenders import BENCH, REPO, await_ready, start_slotgate
from bench.procs import CLIENT_CORE, SERVER_CORE, Server, free_port, spawn

LOGS = BENCH / "results" / "logs"

# tests/standin.py (aiohttp) in a process of its own: it speaks every route an SDK uses
# (/v1/chat/completions, /v1/messages), unlike bench/standin.py.
_STANDIN = """
import asyncio, json, sys
from tests.standin import StandIn

async def main() -> None:
    standin = StandIn(port=int(sys.argv[1]), **json.loads(sys.argv[2]))
    await standin.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def logs() -> Path:
    LOGS.mkdir(parents=True, exist_ok=True)
    return LOGS


def start_standin(**knobs: object) -> Server:
    """tests/standin.py's StandIn with these knobs (total_slots, tokens, token_delay_s...)."""
    import json

    port = free_port()
    command = [sys.executable, "-c", _STANDIN, str(port), json.dumps(knobs)]
    server = spawn("standin", command, port, CLIENT_CORE, logs(), cwd=REPO)
    return await_ready(server, "/props", 30)


def start_hostile(answer: str, total_slots: int = 1, hold_s: float = 1.0) -> Server:
    """tests/hostile.py misbehaving as `answer`; a request whose target ends in ?hold streams."""
    port = free_port()
    command = [
        sys.executable, "-m", "tests.hostile", "--port", str(port), "--answer", answer,
        "--total-slots", str(total_slots), "--hold-s", str(hold_s),
    ]  # fmt: skip
    server = spawn("hostile", command, port, CLIENT_CORE, logs(), cwd=REPO)
    return await_ready(server, "/props", 30)


def start_gate(
    upstream_url: str, env: dict[str, str] | None = None, pythonpath: str | None = None
) -> Server:
    """`python -m slotgate` in front of `upstream_url`, ready; `pythonpath` runs other code."""
    values = dict(env or {})
    if pythonpath:
        values["PYTHONPATH"] = pythonpath
    return start_slotgate("slotgate", upstream_url, logs(), values, core=SERVER_CORE)


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
