"""`python -m bench`: set up, run scenarios 1-6 side by side, write the results and the plots."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from bench import contenders, fleet, llama, provision, report, scenarios
from bench.awake import cores_awake
from bench.contenders import BENCH, Contender
from bench.procs import (
    CLIENT_CORE,
    DEATHS,
    SERVER_CORE,
    USABLE,
    Server,
    descendants,
    pin_self,
    pinning_possible,
    raise_fd_limit,
)
from bench.scenarios import Context, Sizes

ALL_SCENARIOS = ("1", "2", "3", "3b", "4", "5", "6", "burst")
#: Issue 18's scenarios (bench/fleet.py): asked for by name, or all by `python -m bench.fleet`.
FLEET_SCENARIOS = ("fleet-cache", "fleet-cost", "fleet-balance")


def contender_list(sizes: Sizes) -> list[Contender]:
    return [
        Contender("direct", "direct", note="straight to the stand-in (the floor)"),
        Contender("nginx", "nginx", note="nginx-light, 1 worker, upstream keepalive"),
        Contender("litellm", "litellm", note="LiteLLM proxy, 1 worker, openai/ provider"),
        # Not one of issue 6's contenders: no proxy at all, but uvicorn as slotgate runs it,
        # answering every request itself. What is left between it and slotgate is slotgate's.
        Contender(
            "uvicorn-bare",
            "uvicorn",
            note="bench/floor.py --answer: uvicorn alone, no upstream (scenario 1 only)",
        ),
        # uvicorn relaying to the stand-in with nothing a gate does: the floor under any relay
        # uvicorn runs. Between it and uvicorn-bare is what relaying costs; between it and
        # slotgate-plain, what the gate adds.
        Contender(
            "uvicorn-relay",
            "uvicorn-relay",
            note="bench/floor.py --relay: uvicorn relaying, nothing else (scenario 1 only)",
        ),
        Contender("slotgate-high", "slotgate", 1024, note="capacity 1024: nobody waits"),
        Contender(
            "slotgate-low",
            "slotgate",
            sizes.low_slots,
            note=f"capacity {sizes.low_slots}, MAX_QUEUE=0: the queueing path",
            env=(("MAX_QUEUE", "0"),),
        ),
        # Not one of issue 6's contenders: slotgate-high without STREAM_UPSTREAM, which turns
        # every non-streamed request into a stream and assembles the answer, so the table
        # shows what the gate costs and what that feature costs, separately.
        Contender(
            "slotgate-plain",
            "slotgate",
            1024,
            note="capacity 1024, STREAM_UPSTREAM=false: the gate without answer assembly",
            env=(("STREAM_UPSTREAM", "false"),),
        ),
    ]


QUICK = {
    "duration_s": 2.0,
    "warmup_s": 0.5,
    "waiters": 10_000,
    "core_pairs": 100_000,
    "core_repeats": 2,
    "llama_seconds": 15.0,
    "llama_rounds": 1,
}
SMOKE = {
    "duration_s": 0.5,
    "warmup_s": 0.2,
    "concurrency": (1, 4),
    "stream_concurrency": 4,
    "stream_tokens": 8,
    "storm_clients": 40,
    "storm_queue": 8,
    "handoff_clients": 4,
    "waiters": 200,
    "core_pairs": 5_000,
    "core_depth": 1_000,
    "core_repeats": 1,
    "burst_clients": 24,
    "burst_hold_s": 0.005,
    "llama_seconds": 5.0,
    "llama_rounds": 1,
    "llama_clients": 3,
    "llama_max_tokens": 8,
    "loadgen": "python",
    "fleet_systems": 2,
    "fleet_system_words": 40,
    "fleet_conversations": 2,
    "fleet_turns": 2,
    "fleet_max_tokens": 4,
    # One conversation at a time: its next turn always finds its key's engine free.
    "fleet_clients": 1,
    "fleet_think_s": 0.2,
    "fleet_stagger_s": 0.1,
    "fleet_cost_slots": 16,
    "fleet_cost_clients": 4,
    "fleet_cost_rounds": 1,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="slotgate against a direct connection, nginx and LiteLLM, in one run. "
        "Installs nginx-light, wrk, LiteLLM and matplotlib when missing.",
    )
    parser.add_argument("--quick", action="store_true", help="short run (2 s per point)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, to check the bench works (the test suite uses it)",
    )
    parser.add_argument(
        "--contenders",
        default="direct,nginx,litellm,uvicorn-bare,uvicorn-relay,slotgate-high,slotgate-low,slotgate-plain",
        help="comma-separated subset (default: all)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(ALL_SCENARIOS),
        help=f"comma-separated subset of {','.join(ALL_SCENARIOS)} (the default), "
        f"or of {','.join(FLEET_SCENARIOS)} (the fleet's; `python -m bench.fleet`)",
    )
    parser.add_argument(
        "--cores-awake",
        action="store_true",
        help="keep every core out of its idle state during the run (an idle-class spinner on "
        "each; bench/awake.py): wake-ups then do not wait for an idle core to come back",
    )
    parser.add_argument(
        "--fleet-contenders",
        default=",".join(fleet.CACHE_CONTENDERS),
        help="fleet-cache's contenders, in order; slotgate-affinity-eps=X sets ROUTING_EPSILON",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=BENCH / "results",
        help="where latest.json, latest.md and the PNGs go",
    )
    parser.add_argument(
        "--slotgate-tree",
        type=Path,
        default=None,
        help="measure the app/ of another checkout (an A/B of a change); default: this one",
    )
    parser.add_argument(
        "--no-install", action="store_true", help="never run apt-get or pip; skip what is missing"
    )
    for item in fields(Sizes):
        flag = "--" + item.name.replace("_", "-")
        if isinstance(item.default, tuple):
            parser.add_argument(
                flag,
                type=lambda text: tuple(int(c) for c in text.split(",")),
                help="comma-separated numbers",
            )
        elif item.name == "loadgen":
            parser.add_argument(flag, choices=("auto", "wrk", "python"))
        else:
            parser.add_argument(flag, type=type(item.default), metavar="N")
    return parser.parse_args(argv)


def sizes_from(args: argparse.Namespace) -> Sizes:
    values: dict[str, Any] = {}
    if args.quick:
        values.update(QUICK)
    if args.smoke:
        values.update(SMOKE)
    for item in fields(Sizes):
        given = getattr(args, item.name)
        if given is not None:
            values[item.name] = given
    return Sizes(**values)


class Bench:
    """One run: the shared stand-in, the results as they come in, notes on what was skipped."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        self.args = args
        self.sizes = sizes
        self.out: Path = args.out
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.notes: list[str] = []
        self.wanted = set(args.scenarios.split(","))
        unknown = self.wanted - set(ALL_SCENARIOS) - set(FLEET_SCENARIOS)
        if unknown:
            raise SystemExit(f"bench: unknown scenario(s) {sorted(unknown)}")
        names = args.contenders.split(",")
        self.contenders = [c for c in contender_list(sizes) if c.name in names]
        self.results: dict[str, Any] = {"scenarios": {}}
        self.foreign: dict[str, float] = {}

    def step(self, key: str, work: Callable[[], Any]) -> Any:
        """Run one measurement; a failure is recorded in the results rather than ending the run."""
        started = time.monotonic()
        others = _others_cpu_s()
        print(f"bench: {key} ...", flush=True)
        try:
            value = work()
        except Exception as exc:
            traceback.print_exc()
            value = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        elapsed = time.monotonic() - started
        # Other people's processes on this machine skew figures: say how much ran beside us.
        foreign = _foreign_s(others)
        self.foreign[key] = round(foreign / (elapsed * (os.cpu_count() or 1)), 3)
        print(
            f"bench: {key} done in {elapsed:.1f} s (foreign CPU {self.foreign[key]:.1%})",
            flush=True,
        )
        return value

    def available(self, contender: Contender) -> bool:
        if contender.kind == "nginx" and contenders.nginx_binary() is None:
            self.notes.append("nginx is not installed: its contender is skipped")
            return False
        if contender.kind == "litellm" and contenders.litellm_binary() is None:
            self.notes.append("LiteLLM is not installed: its contender is skipped")
            return False
        return True

    def run(self) -> None:
        standin = contenders.start_standin(self.logs)
        try:
            self._run(Context(self.sizes, self.logs, standin, self.notes))
        finally:
            standin.stop()

    def _run(self, ctx: Context) -> None:
        found = self.results["scenarios"]
        per_contender = [key for key in ("1", "2") if key in self.wanted]
        if per_contender:
            for contender in self.contenders:
                if not self.available(contender):
                    continue
                self._contender(ctx, contender, per_contender)
        for key, name, work in (
            ("3", "3_storm", scenarios.storm),
            ("3b", "3b_handoff", scenarios.handoff),
            ("4", "4_memory", scenarios.memory),
            ("5", "5_core", scenarios.core),
            ("burst", "burst", scenarios.burst),
        ):
            if key in self.wanted:
                found[name] = self.step(name, lambda work=work: work(ctx))  # type: ignore[misc]
        if "6" in self.wanted:
            reason = llama.available()
            if reason:
                self.notes.append(reason)
            else:
                found["6_llama"] = self.step("6_llama", lambda: self._llama(ctx))
        self._fleet(ctx)

    def _contender(self, ctx: Context, contender: Contender, keys: list[str]) -> None:
        found = self.results["scenarios"]
        server: Server | dict[str, Any] = self.step(
            f"start {contender.name}", lambda: contenders.start(contender, ctx.standin, ctx.logs)
        )
        if isinstance(server, dict):
            for key, name in (("1", "1_nonstream"), ("2", "2_stream")):
                if key in keys:
                    found.setdefault(name, {})[contender.name] = server
            return
        try:
            if "1" in keys:
                found.setdefault("1_nonstream", {})[contender.name] = self.step(
                    f"1_nonstream {contender.name}", lambda: scenarios.nonstream(ctx, server)
                )
            if "2" in keys and not contender.kind.startswith("uvicorn"):
                found.setdefault("2_stream", {})[contender.name] = self.step(
                    f"2_stream {contender.name}", lambda: scenarios.stream(ctx, server)
                )
        finally:
            if server is not ctx.standin:
                server.stop()

    def _fleet(self, ctx: Context) -> None:
        found = self.results["scenarios"]
        sizes = self.sizes
        if "fleet-cache" in self.wanted:
            reason = llama.available()
            if reason:
                self.notes.append(reason.replace("scenario 6", "fleet-cache"))
            else:
                workload = fleet.Workload(
                    systems=sizes.fleet_systems,
                    conversations=sizes.fleet_conversations,
                    turns=sizes.fleet_turns,
                    max_tokens=sizes.fleet_max_tokens,
                    clients=sizes.fleet_clients,
                    system_words=sizes.fleet_system_words,
                    think_s=sizes.fleet_think_s,
                    stagger_s=sizes.fleet_stagger_s,
                )
                found["fleet_cache"] = self.step(
                    "fleet_cache",
                    lambda: fleet.cache(
                        ctx.logs,
                        workload,
                        sizes.fleet_engines,
                        sizes.fleet_engine_slots,
                        sizes.fleet_ctx_size,
                        bool(sizes.fleet_swa_full),
                        tuple(self.args.fleet_contenders.split(",")),
                        notes=self.notes,
                    ),
                )
        if "fleet-cost" in self.wanted:
            found["fleet_cost"] = self.step(
                "fleet_cost",
                lambda: fleet.cost(
                    ctx.logs,
                    sizes.fleet_cost_upstreams,
                    sizes.fleet_cost_slots,
                    sizes.fleet_cost_clients,
                    sizes.duration_s,
                    sizes.fleet_cost_rounds,
                ),
            )
        if "fleet-balance" in self.wanted:
            found["fleet_balance"] = self.step(
                "fleet_balance",
                lambda: fleet.balance(
                    ctx.logs,
                    sizes.fleet_balance_slots,
                    sizes.fleet_balance_hold_s,
                    sizes.fleet_balance_load,
                    sizes.duration_s,
                ),
            )

    def _llama(self, ctx: Context) -> dict[str, Any]:
        sizes = self.sizes

        def gate(url: str) -> Server:
            # llama.cpp owns the server core here (it plays the GPU); the gate sits with the
            # client, as a gate on a GPU host runs on the CPU beside it.
            return contenders.start_slotgate("slotgate-llama", url, ctx.logs, core=CLIENT_CORE)

        return llama.scenario(
            ctx.logs,
            gate,
            sizes.llama_seconds,
            sizes.llama_rounds,
            sizes.llama_clients,
            sizes.llama_max_tokens,
        )


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}"


def _tree(root: Path) -> str:
    """The slotgate code measured: HEAD, plus the files of app/ that differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--short", "--", "app"],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=10,
            check=False,
        ).stdout.split("\n")
    except OSError:
        return "unknown"
    changed = [line.strip() for line in dirty if line.strip()]
    return head + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")


def _others_cpu_s() -> dict[int, float]:
    """CPU time of every process outside this bench's tree, by pid (reaped children included)."""
    tick = os.sysconf("SC_CLK_TCK")
    ours = set(descendants(os.getpid()))
    found: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parts = stat[stat.rindex(")") + 2 :].split()
        found[int(entry.name)] = sum(int(v) for v in parts[11:15]) / tick
    return found


def _foreign_s(before: dict[int, float]) -> float:
    """CPU other processes used since `before` (those that came and went unseen excepted)."""
    after = _others_cpu_s()
    return sum(max(0.0, used - before.get(pid, 0.0)) for pid, used in after.items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sizes_from(args)
    pin_self(CLIENT_CORE)
    fd_limit = raise_fd_limit()
    if args.slotgate_tree is not None:
        contenders.slotgate_tree = args.slotgate_tree.resolve()
    bench = Bench(args, sizes)
    if not args.no_install:
        litellm = any(c.kind == "litellm" for c in bench.contenders)
        # Only scenarios 1 and 2 run the contenders (the fleet's need no LiteLLM).
        provision.everything(bench.notes, litellm and bool(bench.wanted & {"1", "2"}))
    if not pinning_possible():
        bench.notes.append("fewer than 2 usable cores: nothing is pinned")
    if fd_limit < sizes.waiters + 1000:
        bench.notes.append(f"file-descriptor limit {fd_limit} is low for {sizes.waiters} waiters")
    if not sizes.uses_wrk():
        bench.notes.append("scenario 1 load generator: the bench's Python client (wrk not used)")
    started_wall = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    started = time.monotonic()
    others = _others_cpu_s()
    awake = cores_awake(USABLE) if args.cores_awake else contextlib.nullcontext()
    try:
        with awake:
            bench.run()
    finally:
        duration = time.monotonic() - started
        foreign = _foreign_s(others)
        results = bench.results
        results["meta"] = {
            "started": started_wall,
            "command": "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv),
            "duration_s": round(duration, 1),
            "machine": _machine(),
            "slotgate_tree": _tree(contenders.slotgate_tree),
            "server_core": SERVER_CORE,
            "client_core": CLIENT_CORE,
            "pinned": pinning_possible(),
            "cores_awake": args.cores_awake,
            "foreign_cpu_s": round(foreign, 1),
            "foreign_cpu_share": f"{foreign / (duration * (os.cpu_count() or 1)):.1%}",
            "sizes": dict(vars(sizes)),
            "contenders": {c.name: c.note for c in bench.contenders},
            "notes": bench.notes + DEATHS,
            "foreign_cpu_share_by_step": bench.foreign,
        }
        results["targets"] = report.targets(results)
        write(results, args.out)
    print(report.console(results))
    print(f"bench: finished in {duration:.0f} s; results in {args.out}", flush=True)
    return 0


def write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = report.plots(results, out)
    (out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "latest.md").write_text(report.markdown(results))
