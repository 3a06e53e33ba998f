"""The processes under test: start them pinned to a core, read their CPU time and RSS, stop them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: The core every server under test runs on, and the one the load generator and stand-in share.
SERVER_CORE = 0
CLIENT_CORE = 1
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
#: Servers that ended before the bench stopped them, for the run's notes.
DEATHS: list[str] = []
#: Read once at import, before the runner pins itself to the load generator's core.
USABLE = frozenset(os.sched_getaffinity(0))


def pinning_possible() -> bool:
    return {SERVER_CORE, CLIENT_CORE} <= USABLE


def pin_self(core: int) -> None:
    if pinning_possible():
        os.sched_setaffinity(0, {core})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (nginx's worker, LiteLLM's server process)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found = [pid]
    for current in found:
        found.extend(parents.get(current, []))
    return found


def cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes, in seconds (clock-tick resolution)."""
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total * _TICK_S


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Server:
    """A started process; `pids()` includes its children, which is where nginx does its work."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    #: More ports the same process serves (a stand-in playing several upstreams).
    extra_ports: list[int] = field(default_factory=list)

    def pids(self) -> list[int]:
        return descendants(self.process.pid)

    def cpu_s(self) -> float:
        return cpu_s(self.pids())

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def listening(self) -> bool:
        with socket.socket() as probe:
            probe.settimeout(1.0)
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        """SIGTERM the process, then SIGKILL it and whatever it started that is left."""
        code = self.process.poll()
        if code is not None:
            # It ended before the bench stopped it: say so, or its figures would be a mystery.
            DEATHS.append(
                f"{self.name} exited on its own with status {code} before the bench "
                f"stopped it (log: {self.log})"
            )
        elif self.port and not self.listening():
            DEATHS.append(
                f"{self.name} had stopped listening before the bench stopped it: something "
                "outside the bench signalled it, and its figures from then on are missing"
            )
        children = [pid for pid in self.pids() if pid != self.process.pid]
        if code is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        # Its children (nginx's worker, a server's helpers) by their ids, never by name.
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for step in self.cleanup:
            step()


def spawn(
    name: str,
    command: list[str],
    port: int,
    core: int | None,
    logs: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Server:
    """Start `command` pinned to `core` (None: free on every core), its output in a log file."""
    log = logs / f"{name}.log"
    pin = pinning_possible()

    def setup() -> None:
        if pin:
            os.sched_setaffinity(0, USABLE if core is None else {core})
        _raise_fd_limit()

    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            # Kept in the bench's own process group and session: a server moved to a session
            # of its own looks, to a machine's clean-up, like something left behind, and was
            # seen to be stopped mid-run.
            preexec_fn=setup,
        )
    return Server(name, port, process, log)


def _raise_fd_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def raise_fd_limit() -> int:
    _raise_fd_limit()
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def python() -> str:
    return sys.executable


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str, step_s: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(step_s)
