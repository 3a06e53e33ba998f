"""Cores kept out of their idle state for a run (`python -m bench --cores-awake`).

A core with nothing to run idles, and the next wake-up on it waits for it to come back: on a
virtual machine whose idle state halts the virtual CPU (cpuidle's `haltpoll` with
`guest_halt_poll_ns` 0, as here), a wake-up from another core then goes through the host, and
a hand-off crosses cores twice (the stand-in's last byte wakes slotgate's core, slotgate's
request wakes the stand-in's). A spinner of the idle scheduling class on each core keeps it
from idling and takes no time from anything else that is runnable: the kernel runs a
SCHED_IDLE task only when nothing else wants the core, and preempts it at once for any task
that wakes. `cpupower idle-set -D 0` does the same for the whole machine, and stays.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterable, Iterator

SPIN = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


@contextlib.contextmanager
def cores_awake(cores: Iterable[int]) -> Iterator[list[int]]:
    """One idle-class spinner per core, for the block; it is handed their pids."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN, str(core)], stdin=subprocess.DEVNULL)
        for core in sorted(cores)
    ]
    try:
        yield [spinner.pid for spinner in spinners]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
