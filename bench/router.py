"""Router mode: a real llama-server serving two models from one process, alone and with slotgate
in front, side by side in one run.

    python -m bench.router [--burst 40] [--stream-s 30] [--clients 4] [--max-tokens 8]
                           [--single-s 20] [--rounds 1] [--slotgate-tree DIR]

The binary is llama.cpp's own llama-server (xllamacpp disables router mode): $LLAMA_ROUTER_BIN,
else what `scripts/build-llama-server` prints (it builds once, 8-30 minutes on 2 cores, then
reuses its cache). The models are the demo's gemma-3 270M under two ids, `alpha` and `beta`
(symbolic links to one file). llama.cpp runs on the server core with 1 thread per child and
2 slots; slotgate and the client share the other core, as in bench/llama.py.

- swap: `--models-max 1`, so a request for the other model makes the router evict one and load
  the other. For each contender, a fresh router with `alpha` loaded, then `--burst` streamed
  chat completions at once alternating the two models, then a steady alternating stream
  (`--clients` clients in a closed loop for `--stream-s` seconds, each alternating models
  request by request). Measured per phase: model loads (the router's own log, one line per
  child it starts), completed requests per second, the longest wait per model (time to the
  first token of its slowest request), and requests cut (a 200 stream without its finish or
  `[DONE]`, or a 5xx from the router: what an eviction of a running child would leave) apart
  from requests refused by slotgate (429/503 with Retry-After). Contenders: the router alone,
  and slotgate (`MAX_QUEUE=0`, `STARTUP_WAIT_S` from `--startup-wait-s`) in front of it.
- single: one model, `2 x slots` clients in a closed loop for `--single-s` seconds, through the
  router, through slotgate in front of the router, straight to `llama-server -m` with the same
  flags, and through slotgate in front of that: tokens per second and requests per second
  (the mean of `--rounds` rounds, every other round in the reverse order).

Results: bench/results/router/latest.json and latest.md (the tables printed at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from slotgate.engine.model import demo_model

from bench import contenders
from bench.contenders import BENCH, REPO, await_ready, start_slotgate
from bench.loop import run_loop
from bench.procs import CLIENT_CORE, DEATHS, SERVER_CORE, Server, free_port, pin_self, spawn
from bench.stats import percentile, ratio
from tests.support.real_router import chat, command, loads, models_dir

MODELS = ("alpha", "beta")
SLOTS = 2
OUT = BENCH / "results" / "router"


def router_binary() -> Path:
    """$LLAMA_ROUTER_BIN, else the cached build (built first when there is none)."""
    if named := os.environ.get("LLAMA_ROUTER_BIN"):
        return Path(named)
    print("llama-server: scripts/build-llama-server (a first build takes 8-30 minutes)")
    built = subprocess.run(
        [str(REPO / "scripts" / "build-llama-server")], check=True, stdout=subprocess.PIPE
    )
    return Path(built.stdout.decode().strip())


# -- one request ----------------------------------------------------------------------------------


@dataclass
class Answer:
    """One streamed chat completion as the client saw it."""

    model: str
    status: int = 0
    first_token_s: float | None = None
    total_s: float = 0.0
    tokens: int = 0
    finished: bool = False  # its finish_reason and `[DONE]` arrived
    error: str = ""

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finished

    @property
    def refused(self) -> bool:
        return self.status in (429, 503)

    @property
    def waited_s(self) -> float:
        """Until its first token; a request that never got one waited all of its time."""
        return self.first_token_s if self.first_token_s is not None else self.total_s


async def ask(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> Answer:
    answer = Answer(model)
    started = time.monotonic()
    finish = done = False
    body = chat(model, max_tokens, stream=True)
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            answer.status = response.status_code
            if response.status_code != 200:
                answer.error = (await response.aread())[:200].decode(errors="replace")
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        answer.error = json.dumps(event["error"])[:200]
                    for choice in event.get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            if answer.first_token_s is None:
                                answer.first_token_s = time.monotonic() - started
                            answer.tokens += 1
                        finish = finish or bool(choice.get("finish_reason"))
    except httpx.HTTPError as exc:
        answer.error = repr(exc)[:200]
    answer.total_s = time.monotonic() - started
    answer.finished = finish and done
    return answer


def client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=900, limits=limits)


# -- the servers ----------------------------------------------------------------------------------


def start_llama(name: str, binary: Path, serves: list[str], logs: Path) -> Server:
    port = free_port()
    server = spawn(name, command(binary, port, serves), port, SERVER_CORE, logs)
    return await_ready(server, "/health", 120)


def start_router(binary: Path, models: Path, logs: Path, name: str, models_max: int) -> Server:
    serves = ["--models-dir", str(models), "--models-max", str(models_max)]
    return start_llama(name, binary, serves, logs)


def url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}"


@contextlib.contextmanager
def stopped(*servers: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for server in reversed(servers):
            server.stop()


def gate(name: str, upstream: Server, logs: Path, startup_wait_s: float) -> Server:
    env = {"MAX_QUEUE": "0", "STARTUP_WAIT_S": str(startup_wait_s)}
    return start_slotgate(name, url(upstream), logs, env, core=CLIENT_CORE)


def model_loads(router: Server) -> list[str]:
    return loads(router.log.read_text(errors="replace"))


# -- swap -----------------------------------------------------------------------------------------


def summary(answers: list[Answer], wall_s: float, loaded: list[str]) -> dict[str, Any]:
    completed = [a for a in answers if a.completed]
    cut = [a for a in answers if not a.completed and not a.refused]
    return {
        "sent": len(answers),
        "completed": len(completed),
        "refused": sum(a.refused for a in answers),
        "cut": len(cut),
        "cut_errors": sorted({f"{a.status} {a.error}"[:120] for a in cut})[:5],
        "model_loads": len(loaded),
        "loads_in_order": loaded,
        "wall_s": round(wall_s, 2),
        "completed_per_s": round(len(completed) / wall_s, 3) if wall_s else None,
        "longest_wait_s": {
            model: round(max((a.waited_s for a in answers if a.model == model), default=0.0), 2)
            for model in MODELS
        },
        "first_token_p50_s": percentile([a.waited_s for a in completed], 50),
    }


async def swap_phases(
    target: str, router: Server, burst: int, clients: int, seconds: float, max_tokens: int
) -> dict[str, Any]:
    async with client() as c:
        mark = len(model_loads(router))
        started = time.monotonic()
        answers = await asyncio.gather(
            *(ask(c, target, MODELS[n % 2], max_tokens) for n in range(burst))
        )
        phases = {"burst": summary(answers, time.monotonic() - started, model_loads(router)[mark:])}

        mark = len(model_loads(router))
        streamed: list[Answer] = []
        deadline = time.monotonic() + seconds

        async def alternate(first: int) -> None:
            n = first
            while time.monotonic() < deadline:
                streamed.append(await ask(c, target, MODELS[n % 2], max_tokens))
                n += 1

        started = time.monotonic()
        await asyncio.gather(*(alternate(i) for i in range(clients)))
        wall = time.monotonic() - started
        phases["stream"] = summary(streamed, wall, model_loads(router)[mark:])
    return phases


async def warm(target: str, model: str) -> None:
    """Load `model` (a one-token request) so every contender starts from the same state."""
    async with client() as c:
        answer = await ask(c, target, model, 1)
    if not answer.completed:
        raise RuntimeError(f"warm-up for {model} failed: {answer}")


def swap(binary: Path, models: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {"router": [], "slotgate": []}
    for round_ in range(args.rounds):
        # Each round in the other order, so that drift hits both alike.
        for name in list(results) if round_ % 2 == 0 else list(results)[::-1]:
            router = start_router(binary, models, logs, f"swap-{name}-{round_}", models_max=1)
            with stopped(router):
                run_loop(warm(url(router), MODELS[0]))
                if name == "router":
                    target = url(router)
                    found = run_loop(
                        swap_phases(
                            target, router, args.burst, args.clients, args.stream_s,
                            args.max_tokens,
                        )
                    )  # fmt: skip
                else:
                    try:
                        front = gate(f"slotgate-{round_}", router, logs, args.startup_wait_s)
                    except RuntimeError as exc:
                        results[name].append({"error": str(exc).splitlines()[0]})
                        continue
                    with stopped(front):
                        found = run_loop(
                            swap_phases(
                                url(front), router, args.burst, args.clients, args.stream_s,
                                args.max_tokens,
                            )
                        )  # fmt: skip
                results[name].append(found)
    return results


# -- one model ------------------------------------------------------------------------------------


async def closed(target: str, model: str, clients: int, seconds: float, max_tokens: int) -> Any:
    async with client() as c:
        answers: list[Answer] = []
        deadline = time.monotonic() + seconds

        async def loop() -> None:
            while time.monotonic() < deadline:
                answers.append(await ask(c, target, model, max_tokens))

        started = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(clients)))
        wall = time.monotonic() - started
    completed = [a for a in answers if a.completed]
    return {
        "completed": len(completed),
        "failed": len(answers) - len(completed),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(completed) / wall, 3),
        "tokens_per_s": round(sum(a.tokens for a in completed) / wall, 2),
    }


def single(binary: Path, models: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    model = MODELS[0]
    router = start_router(binary, models, logs, "single-router", models_max=1)
    direct = start_llama(
        "single-direct", binary, ["-m", str(models / f"{model}.gguf"), "--alias", model], logs
    )
    results: dict[str, Any] = {}
    with stopped(router, direct):
        fronts: dict[str, Server] = {}
        for name, upstream in (("router", router), ("direct", direct)):
            run_loop(warm(url(upstream), model))
            try:
                fronts[name] = gate(f"slotgate-{name}", upstream, logs, args.startup_wait_s)
            except RuntimeError as exc:
                results[f"slotgate+{name}"] = {"error": str(exc).splitlines()[0]}
        with stopped(*fronts.values()):
            contenders = [
                (label, target)
                for name, upstream in (("router", router), ("direct", direct))
                for label, target in ((name, upstream), (f"slotgate+{name}", fronts.get(name)))
                if target is not None
            ]
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in contenders}
            # Each round in the other order, so that drift hits every contender alike.
            for round_ in range(args.rounds):
                for label, target in contenders if round_ % 2 == 0 else contenders[::-1]:
                    runs[label].append(
                        run_loop(
                            closed(url(target), model, 2 * SLOTS, args.single_s, args.max_tokens)
                        )
                    )
    for label, each in runs.items():
        results[label] = {
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in each) / len(each), 2),
            "requests_per_s": round(sum(r["requests_per_s"] for r in each) / len(each), 3),
            "failed": sum(r["failed"] for r in each),
            "rounds": each,
        }
    return results


# -- report ---------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Router mode, {results['when']} (before: {results['load_before']}; after: "
        f"{results['load']}); burst {results['args']['burst']}, "
        f"stream {results['args']['stream_s']} s x {results['args']['clients']} clients, "
        f"{results['args']['max_tokens']} tokens per answer.",
        "",
        "| swap (--models-max 1) | phase | loads | completed/s | longest wait alpha / beta (s) "
        "| cut | refused | completed / sent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results["swap"].items():
        for run in runs:
            if "error" in run:
                lines.append(f"| {name} | - | {run['error']} | | | | | |")
                continue
            for phase in ("burst", "stream"):
                p = run[phase]
                waits = " / ".join(str(p["longest_wait_s"][m]) for m in MODELS)
                lines.append(
                    f"| {name} | {phase} | {p['model_loads']} | {p['completed_per_s']} | {waits} "
                    f"| {p['cut']} | {p['refused']} | {p['completed']} / {p['sent']} |"
                )
    lines += ["", "| one model | tokens/s | requests/s | failed |", "|---|---|---|---|"]
    for name, run in results["single"].items():
        if "error" in run:
            lines.append(f"| {name} | {run['error']} | | |")
        else:
            lines.append(
                f"| {name} | {run['tokens_per_s']} | {run['requests_per_s']} | {run['failed']} |"
            )
    slotgate = [r for r in results["swap"].get("slotgate", []) if "error" not in r]
    alone = [r for r in results["swap"].get("router", []) if "error" not in r]
    for phase in ("burst", "stream") if slotgate and alone else ():
        through = sum(r[phase]["completed_per_s"] for r in slotgate) / len(slotgate)
        direct = sum(r[phase]["completed_per_s"] for r in alone) / len(alone)
        lines.append(f"\n{phase}: slotgate / router alone, completed/s: {ratio(through, direct)}")
    routed = results["single"].get("slotgate+router", {}).get("tokens_per_s")
    served = results["single"].get("slotgate+direct", {}).get("tokens_per_s")
    if routed is not None and served is not None:
        lines.append(f"\nslotgate+router / slotgate+direct, tokens/s: {ratio(routed, served)}")
    return "\n".join(lines) + "\n"


def foreign_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burst", type=int, default=40)
    parser.add_argument("--stream-s", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--single-s", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1, help="alternated swap rounds")
    parser.add_argument("--startup-wait-s", type=float, default=600.0)
    parser.add_argument("--skip", choices=("swap", "single"), action="append", default=[])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--slotgate-tree", type=Path, help="a folder holding the slotgate package to run"
    )
    args = parser.parse_args(argv)
    if args.slotgate_tree is not None:
        contenders.slotgate_tree = args.slotgate_tree.resolve()
    binary = router_binary()
    pin_self(CLIENT_CORE)
    logs = Path(tempfile.mkdtemp(prefix="slotgate-bench-router-"))
    models = models_dir(logs / "models", MODELS, demo_model())
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": foreign_load(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "binary": str(binary),
        "slotgate_tree": str(contenders.slotgate_tree),
        "logs": str(logs),
        "swap": swap(binary, models, logs, args) if "swap" not in args.skip else {},
        "single": single(binary, models, logs, args) if "single" not in args.skip else {},
    }
    results["load"] = foreign_load()
    results["deaths"] = list(DEATHS)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2) + "\n")
    text = markdown(results)
    (args.out / "latest.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
