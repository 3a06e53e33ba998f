"""The training run of slotgate's profile-guided build: the compiled build's C is compiled a
first time with GCC's instrumentation (`-fprofile-generate`), that build relays requests to
the stand-in, and what it ran is left in a profile folder, which the final build reads
(`-fprofile-use`): GCC then lays the code a request runs out together, apart from the code
it never runs, and inlines and orders branches by what it saw.

    python -m bench.experiments.pgo PROFILE_DIR

Run from a checkout; the final build follows, from the same folder (GCC finds an object's
profile by the object's path); `python -m bench.experiments.compiled DIR --pgo` does both:

    SLOTGATE_COMPILE=1 SLOTGATE_PROFILE=PROFILE_DIR pip install --no-build-isolation --no-deps .

setup.py holds the compiler's flags for both builds. The training relays the plain path; what
it does not reach (tenants, a KV budget, several upstreams) is optimised as without a profile.
Needs what the compiled build needs (setup.py): a C compiler, mypy and setuptools importable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import contenders, loadgen
from bench.scenarios import CHAT

#: The training's parts: (slotgate's settings, stream?, concurrency, seconds), each a closed
#: loop of chat requests. The like-for-like path (answers read whole from llama-server) and the
#: default one (streamed from it), answers streamed and not, one client and many.
WORKLOAD: tuple[tuple[dict[str, str], bool, int, float], ...] = (
    ({"STREAM_UPSTREAM": "false"}, False, 1, 2.0),
    ({"STREAM_UPSTREAM": "false"}, False, 32, 3.0),
    ({}, False, 32, 3.0),
    ({}, True, 8, 3.0),
)


def build_instrumented(source: Path, target: Path, profile: Path) -> None:
    """slotgate from `source`, compiled with GCC's instrumentation writing to `profile`, into
    `target`. The objects are built in `source`/build, removed before and after: the final
    build must compile every object again, with the profile."""
    shutil.rmtree(source / "build", ignore_errors=True)
    env = {**os.environ, "SLOTGATE_COMPILE": "1", "SLOTGATE_PROFILE_GENERATE": str(profile)}
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation",
            "--no-deps", "--no-cache-dir", "--target", str(target), str(source),
        ],
        env=env,
        check=True,
    )  # fmt: skip
    shutil.rmtree(source / "build", ignore_errors=True)


async def _drive(port: int, stream: bool, concurrency: int, seconds: float) -> int:
    raw = loadgen.request_bytes(port, CHAT, loadgen.chat_body(stream=stream))
    result = await loadgen.closed_loop(port, raw, concurrency, seconds, streaming=stream)
    return result.statuses[200]


def train(tree: Path, logs: Path) -> int:
    """Run slotgate from the instrumented `tree` through WORKLOAD; the requests answered 200."""
    contenders.slotgate_tree = tree
    standin = contenders.start_standin(logs)
    answered = 0
    try:
        contenders.configure_standin(standin, slots=64)
        for settings, stream, concurrency, seconds in WORKLOAD:
            gate = contenders.start_slotgate(
                "slotgate", f"http://127.0.0.1:{standin.port}", logs, settings, core=None
            )
            try:
                answered += asyncio.run(_drive(gate.port, stream, concurrency, seconds))
            finally:
                # SIGTERM: slotgate exits, and the instrumentation writes its counts then.
                gate.stop()
    finally:
        standin.stop()
    return answered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="the folder to leave the profile in")
    args = parser.parse_args(argv)
    profile = args.profile.resolve()
    shutil.rmtree(profile, ignore_errors=True)
    profile.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="slotgate-pgo-") as scratch:
        tree, logs = Path(scratch) / "tree", Path(scratch) / "logs"
        logs.mkdir()
        build_instrumented(contenders.REPO, tree, profile)
        answered = train(tree, logs)
    counts = list(profile.glob("*.gcda"))
    if not answered or not counts:
        print(f"the training run left no profile (answered {answered})", file=sys.stderr)
        return 1
    print(f"profile of {answered} relayed requests in {profile} ({len(counts)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
