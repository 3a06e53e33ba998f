"""Profile slotgate with py-spy under one bench scenario and summarise where its time goes.

    python -m bench.profile nonstream|stream|storm|handoff|fleet [--seconds 10] [--env KEY=VALUE]
        [--upstreams 8] [--svg PATH]

Starts the stand-in (core 1) and slotgate (core 0) as the bench does, drives the scenario's
load from core 1, samples slotgate with `py-spy record --nonblocking` and writes the raw
stacks and a self/inclusive table per function to bench/results/profile-SCENARIO.txt
(`--svg`: a flame graph too, from a second sampler over the same run).
`fleet` is fleet-cost's load (16 clients, non-streamed, 64 slots split over `--upstreams`
stand-in ports of one stand-in process), to compare one upstream with several.
Needs py-spy (`pip install py-spy`); it is not installed by the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import contenders, loadgen
from bench.contenders import BENCH, configure_standin, start_slotgate, start_standin
from bench.loadgen import chat_body, closed_loop, request_bytes
from bench.loop import run_loop
from bench.procs import CLIENT_CORE, Server, pin_self, raise_fd_limit

CHAT = "/v1/chat/completions"
_LINE = re.compile(r":\d+\)")


def _load(scenario: str, gate: Server, standin: Server, seconds: float) -> int | None:
    """Drives the scenario; the requests answered 200 where the load generator counts them."""
    if scenario == "nonstream":
        body = chat_body(stream=False)
        if loadgen.wrk_available():
            loadgen.wrk(gate.port, CHAT, body, 32, seconds)
            return None
        run_loop(closed_loop(gate.port, request_bytes(gate.port, CHAT, body), 32, seconds))
    elif scenario == "stream":
        configure_standin(standin, tokens=64, token_delay_s=0.001)
        raw = request_bytes(gate.port, CHAT, chat_body(stream=True, max_tokens=64))
        run_loop(closed_loop(gate.port, raw, 64, seconds, streaming=True))
    elif scenario == "fleet":
        raw = request_bytes(gate.port, CHAT, chat_body(stream=False))
        return run_loop(closed_loop(gate.port, raw, 16, seconds)).statuses[200]
    elif scenario == "handoff":
        configure_standin(standin, hold_s=0.002)
        raw = request_bytes(gate.port, CHAT, chat_body(stream=False))
        run_loop(closed_loop(gate.port, raw, 16, seconds))
    else:
        run_loop(_storm(gate, seconds))
    return None


async def _storm(gate: Server, seconds: float) -> None:
    holders = await loadgen.connect(gate.port, 66)
    hang = request_bytes(gate.port, CHAT + "?hang=1", chat_body(stream=False))
    for holder in holders:
        holder.send(hang, None)
    await asyncio.sleep(1.0)
    raw = request_bytes(gate.port, CHAT, chat_body(stream=False))
    await closed_loop(gate.port, raw, 1000, seconds)
    for holder in holders:
        holder.close()


def summarise_total(raw: str) -> int:
    """How many samples py-spy's collapsed stacks hold."""
    return sum(
        int(count) for line in raw.splitlines() if (count := line.rpartition(" ")[2]).isdigit()
    )


#: The parts of one relayed request, for `parts`: a sample belongs to the first part one of
#: whose markers its stack names, looked for from the innermost frame out (so the write
#: under the answer's send counts as the answer's, not the app's that called it).
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("accounting: metrics, access log",
     ("proxy/accounting.py", "/metrics.py", "/logs.py", "logging/")),
    ("admission enter/release", ("/gate/", "/replicas/")),
    ("client-gone watch", ("proxy/watch.py",)),
    ("relay/answer, the client write",
     ("Cycle.send", "Cycle._head_bytes", "Cycle._body_bytes", "proxy/answer.py",
      "proxy/modes.py", "relayed (")),
    ("upstream client write/read",
     ("/upstreams/", "upstream_headers", "_quoted", "Proxy._forward ",
      "Proxy._relay_answer", "Proxy._forward_when_up")),
    ("intake: head, body, demand",
     ("/intake/", "proxy/request.py", "Proxy._take_in", "Proxy._enter",
      "Cycle.receive", "body_bytes.py")),
    ("ASGI app entry",
     ("Cycle.run_asgi", "Gateway.__call__", "Proxy.__call__",
      "Proxy._gated_exchange", "Connection._start")),
    ("HTTP protocol: parse, cycle, keep-alive", ("httptools_impl.py", "proxy/protocol.py",
     "proxy/cycle.py", "flow_control")),
)  # fmt: skip
LOOP = "event loop, system calls (uvloop)"


def parts(raw: str) -> dict[str, float]:
    """Each part's share of the samples (PARTS; the rest is the loop's), largest first."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            counts[_part(stack.split(";"))] += int(count)
    total = sum(counts.values()) or 1
    return {name: n / total for name, n in counts.most_common()}


def _part(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, markers in PARTS:
            if any(marker in frame for marker in markers):
                return name
    return LOOP


def summarise(raw: str, top: int = 30) -> str:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        frames = [_LINE.sub(")", frame) for frame in stack.split(";")]
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    if not total:
        return "no samples\n"
    out = [f"{total} samples (idle excluded)", "", "self %  function"]
    out += [f"{n / total:6.1%}  {frame}" for frame, n in own.most_common(top)]
    out += ["", "incl %  function"]
    out += [f"{n / total:6.1%}  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=("nonstream", "stream", "storm", "handoff", "fleet"))
    parser.add_argument("--upstreams", type=int, default=8, help="fleet: stand-in upstreams")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    parser.add_argument(
        "--svg", type=Path, help="also write a flame graph of the same samples' run there"
    )
    parser.add_argument(
        "--slotgate-tree",
        type=Path,
        help="profile the app/ of another checkout: a folder holding a slotgate/ package, as "
        "for `python -m bench --slotgate-tree` (default: this checkout on PYTHONPATH, where "
        "`import slotgate` finds the installed package: another worktree's needs this)",
    )
    args = parser.parse_args()
    if args.slotgate_tree is not None:
        contenders.slotgate_tree = args.slotgate_tree.resolve()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("bench.profile: py-spy is not installed (pip install py-spy)")
    pin_self(CLIENT_CORE)
    raise_fd_limit()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    env = dict(item.split("=", 1) for item in args.env)
    slots = {"storm": 2, "handoff": 2}.get(args.scenario, 1024)
    if args.scenario == "storm":
        env.setdefault("MAX_QUEUE", "64")
    fleet = args.scenario == "fleet"
    upstreams = args.upstreams if fleet else 1
    standin = start_standin(logs, extra_ports=upstreams - 1)
    try:
        ports = [standin.port, *standin.extra_ports]
        for port in ports:
            loadgen.http_json(port, "/_bench/config", {
                "slots": 64 // upstreams if fleet else slots, "tokens": 16, "token_delay_s": 0,
                "hold_s": 0, "record_gaps": False,
            })  # fmt: skip
        urls = ",".join(f"http://127.0.0.1:{port}" for port in ports)
        gate = start_slotgate("slotgate-profile", urls, logs, env)
        try:
            name = f"{args.scenario}-{upstreams}" if fleet else args.scenario
            raw_path = args.out / f"profile-{name}.raw"
            record = subprocess.Popen(
                [spy, "record", "--nonblocking", "--function", "--format", "raw",
                 "--rate", "250", "--duration", str(int(args.seconds)), "--output",
                 str(raw_path), "--pid", str(gate.process.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            recorders = [record]
            if args.svg is not None:
                flame = [spy, "record", "--nonblocking", "--format", "flamegraph", "--rate",
                         "250", "--duration", str(int(args.seconds)), "--output",
                         str(args.svg), "--pid", str(gate.process.pid)]  # fmt: skip
                recorders.append(
                    subprocess.Popen(flame, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                )
            time.sleep(0.5)
            cpu_before = gate.cpu_s()
            served = _load(args.scenario, gate, standin, args.seconds + 1.0)
            cpu_used = gate.cpu_s() - cpu_before
            for recorder in recorders:
                recorder.wait(timeout=60)
        finally:
            gate.stop()
    finally:
        standin.stop()
    summary = summarise(raw_path.read_text())
    summary += "\nshare  part\n" + "".join(
        f"{share:6.1%}  {name}\n" for name, share in parts(raw_path.read_text()).items()
    )
    header = f"py-spy profile of slotgate, scenario {name}, env {env or 'defaults'}\n"
    if served:
        samples = summarise_total(raw_path.read_text())
        header += (
            f"{served} requests answered 200, {cpu_used / served * 1e3:.4f} ms CPU each, "
            f"{samples / served * 1e3:.1f} samples per 1,000\n"
        )
    header += "\n"
    (args.out / f"profile-{name}.txt").write_text(header + summary)
    print(header + summary)


if __name__ == "__main__":
    main()
