"""Issue 18's fleet scenarios: one gate in front of several upstreams.

- `fleet-cache`: three real llama.cpp engines (xllamacpp, the PyPI gemma-3 270M, 1 thread
  each, `cache_prompt` on as llama-server has it by default) and a multi-turn workload of
  conversations that share long system prompts, streamed through slotgate with
  `ROUTING=affinity`, slotgate with `ROUTING=least-loaded` and nginx `least_conn`. The engines
  are restarted before each contender, so none starts with a warm cache. Measured: the prompt
  tokens reused (llama-server's `timings.cache_n` over `cache_n + prompt_n`), time to first
  token, the workload's wall time, `llamacpp:requests_deferred` on every engine (scraped every
  2 s) and how soon every slot of every engine is idle after the last answer.
- `fleet-cost`: slotgate's CPU per request in front of 1 and of 8 stand-in upstreams (one
  stand-in process, one port per upstream, the same total slots), without an affinity key
  (`ROUTING=least-loaded`) and with one (`ROUTING=affinity`, a `prompt_cache_key` per
  connection): at one offered rate (an open loop at 0.7 of the slower gate's saturated rate in
  that round), and saturated (a closed loop of 16 clients).
- `fleet-balance`: upstreams of 1, 2 and 4 slots, no affinity key, uniform load (an open loop
  at a share of the fleet's capacity): each upstream's share of the busy time, read from the
  stand-ins' own counters, against its share of the capacity.

Chat completions, not raw `/completion`: that is what clients send, and a chat's affinity key
(its first messages) is then the shared system prompt. The model carries no chat template, so
the engines use llama.cpp's built-in `gemma` one, as `slotgate --demo` does.

`python -m bench.fleet` runs the three (results in bench/results/fleet/); they are also
`python -m bench --scenarios fleet-cache,fleet-cost,fleet-balance`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.contenders import (
    BENCH,
    REPO,
    await_ready,
    nginx_binary,
    start_nginx,
    start_slotgate,
    start_standin,
)
from bench.loadgen import chat_body, closed_loop, request_bytes
from bench.loop import run_loop
from bench.procs import CLIENT_CORE, Server, free_port, spawn
from bench.stats import percentile, ratio

CHAT = "/v1/chat/completions"
#: What routes each fleet-cache contender, in the order they run. `slotgate-affinity-eps=X`
#: is slotgate-affinity with ROUTING_EPSILON=X.
CACHE_CONTENDERS = ("slotgate-affinity", "slotgate-least-loaded", "nginx-least-conn")
_ROUTED = re.compile(
    r'^slotgate_upstream_routed_total\{[^}]*reason="(\w+)"[^}]*\}\s+(\S+)', re.MULTILINE
)
_DEFERRED = re.compile(rb"^llamacpp:requests_deferred\s+(\S+)", re.MULTILINE)
_PROMPT_TOKENS = re.compile(rb"^llamacpp:prompt_tokens_total\s+(\S+)", re.MULTILINE)
#: llama.cpp's /slots and /metrics post a task each; scraping faster disturbs it (LLAMA_SERVER).
SCRAPE_S = 2.0


# -- the workload ---------------------------------------------------------------------------------

_COMPANIES = (
    "Northwind Traders",
    "Contoso Outdoor",
    "Fabrikam Insurance",
    "Tailspin Travel",
    "Litware Books",
    "Adventure Works Cycles",
    "Wingtip Toys",
    "Proseware Clinics",
)
_TOPICS = (
    "a late delivery",
    "a damaged parcel",
    "a refund",
    "an invoice",
    "a changed address",
    "a lost password",
    "a cancelled order",
    "a warranty claim",
    "a missing item",
    "a double charge",
)
_ACTIONS = (
    "apologise once and briefly",
    "ask for the order number",
    "quote the policy section by its number",
    "offer a voucher only after a second complaint",
    "never promise a delivery date",
    "escalate to a supervisor when the customer asks twice",
    "confirm the postal code before any change",
    "keep the answer under three sentences",
    "write the tracking link in full",
    "thank the customer for their patience",
    "check the payment status first",
    "explain the fourteen day return window",
)


def system_prompts(count: int, words: int, seed: int = 18) -> list[str]:
    """`count` distinct support-desk system prompts of about `words` words each."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        company = _COMPANIES[index % len(_COMPANIES)]
        text = [f"You are the customer support assistant of {company} (desk {index})."]
        rule = 0
        while sum(len(part.split()) for part in text) < words:
            rule += 1
            text.append(
                f"Rule {rule}: when a customer writes about {rng.choice(_TOPICS)}, "
                f"{rng.choice(_ACTIONS)} and {rng.choice(_ACTIONS)}."
            )
        prompts.append(" ".join(text))
    return prompts


@dataclass(frozen=True)
class Workload:
    """Conversations over shared system prompts, each played turn by turn by its own client:
    conversation i starts i * `stagger_s` in, and its user reads each answer for a think time
    drawn from [0.5, 1.5] x `think_s` (seeded, so every contender sees the same schedule).
    At most `clients` conversations run at once."""

    systems: int = 4
    conversations: int = 12
    turns: int = 5
    max_tokens: int = 64
    clients: int = 6
    system_words: int = 260
    think_s: float = 3.0
    stagger_s: float = 0.5

    def prompts(self) -> list[str]:
        return system_prompts(self.systems, self.system_words)

    def question(self, conversation: int, turn: int) -> str:
        topic = _TOPICS[(conversation * 7 + turn * 3) % len(_TOPICS)]
        return f"Customer {conversation + 1}, message {turn + 1}: I am writing about {topic}."


@dataclass
class Answer:
    conversation: int
    turn: int
    status: int
    ttft_s: float | None = None
    total_s: float = 0.0
    cache_n: int = 0
    prompt_n: int = 0
    error: str = ""


async def _ask(
    session: Any, url: str, messages: list[dict[str, str]], max_tokens: int, answer: Answer
) -> str:
    """One streamed chat completion; fills `answer` and returns the assistant's text."""
    body = {
        "model": "gemma",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        # Every answer runs its full length, so every contender does the same decoding.
        "ignore_eos": True,
    }
    sent = time.monotonic()
    text: list[str] = []
    async with session.post(url + CHAT, json=body) as response:
        answer.status = response.status
        if response.status != 200:
            answer.error = (await response.text())[:200]
            return ""
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                answer.error = json.dumps(event["error"])[:200]
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if answer.ttft_s is None:
                        answer.ttft_s = time.monotonic() - sent
                    text.append(content)
            timings = event.get("timings")
            if timings:
                answer.cache_n = int(timings.get("cache_n", 0))
                answer.prompt_n = int(timings.get("prompt_n", 0))
    answer.total_s = time.monotonic() - sent
    return "".join(text)


async def play(url: str, workload: Workload) -> tuple[list[Answer], float]:
    """Every conversation, turn by turn, `workload.clients` at a time; the answers and the
    wall time of the whole workload."""
    import aiohttp

    systems = workload.prompts()
    answers: list[Answer] = []
    room = asyncio.Semaphore(workload.clients)
    timeout = aiohttp.ClientTimeout(total=900)
    # A connection per request: llama-server closes its own after every streamed answer, and a
    # client racing that close would fail requests that no contender caused.
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout
    ) as session:

        async def converse(conversation: int) -> None:
            think = random.Random(conversation)
            await asyncio.sleep(conversation * workload.stagger_s)
            async with room:
                messages = [{"role": "system", "content": systems[conversation % len(systems)]}]
                for turn in range(workload.turns):
                    if turn:
                        await asyncio.sleep(think.uniform(0.5, 1.5) * workload.think_s)
                    messages.append(
                        {"role": "user", "content": workload.question(conversation, turn)}
                    )
                    answer = Answer(conversation, turn, 0)
                    answers.append(answer)
                    try:
                        reply = await _ask(session, url, messages, workload.max_tokens, answer)
                    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                        answer.error = f"{type(exc).__name__}: {exc}"[:200]
                        return
                    if answer.error:
                        return
                    messages.append({"role": "assistant", "content": reply})

        started = time.monotonic()
        await asyncio.gather(*(converse(index) for index in range(workload.conversations)))
        return answers, time.monotonic() - started


# -- the engines ----------------------------------------------------------------------------------


@dataclass
class Engines:
    """Local llama.cpp engines, each on its own port, free to run on every core: three engines
    of one thread on one core would leave each a third of it."""

    servers: list[Server] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{server.port}" for server in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def start_engines(
    logs: Path, count: int, slots: int, ctx_size: int, tag: str, swa_full: bool
) -> Engines:
    """`count` engines started at once; each has `slots` slots of `ctx_size / slots` tokens."""
    engines = Engines()
    try:
        for index in range(count):
            port = free_port()
            command = [
                sys.executable, "-m", "bench.llama", "--port", str(port), "--slots", str(slots),
                "--ctx-size", str(ctx_size), "--chat-template", "gemma", "--batch-1",
            ] + (["--swa-full"] if swa_full else [])  # fmt: skip
            name = f"llama-{tag}-{index}"
            engines.servers.append(spawn(name, command, port, None, logs, cwd=REPO))
        for server in engines.servers:
            await_ready(server, "/health", 180)
    except BaseException:
        engines.stop()
        raise
    return engines


async def _scrape(session: Any, url: str) -> bytes:
    async with session.get(url + "/metrics") as response:
        body: bytes = await response.read()
        return body


def _number(pattern: re.Pattern[bytes], text: bytes) -> float | None:
    found = pattern.search(text)
    return float(found.group(1)) if found else None


async def _idle_after(session: Any, urls: list[str], limit_s: float) -> float | None:
    """Seconds until every slot of every engine reports `is_processing` false; None if that
    takes longer than `limit_s`."""
    started = time.monotonic()
    while time.monotonic() - started <= limit_s:
        busy = False
        for url in urls:
            async with session.get(url + "/slots") as response:
                slots = await response.json()
            busy = busy or any(slot.get("is_processing") for slot in slots)
        if not busy:
            return round(time.monotonic() - started, 3)
        await asyncio.sleep(0.1)
    return None


async def measure(target: str, urls: list[str], workload: Workload) -> dict[str, Any]:
    """Play the workload at `target`; sample the engines' deferral while it runs."""
    import aiohttp

    deferred: list[list[float]] = [[] for _ in urls]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as scraper:

        async def sample() -> None:
            while True:
                for index, url in enumerate(urls):
                    value = _number(_DEFERRED, await _scrape(scraper, url))
                    if value is not None:
                        deferred[index].append(value)
                await asyncio.sleep(SCRAPE_S)

        sampler = asyncio.create_task(sample())
        try:
            answers, wall_s = await play(target, workload)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        idle_s = await _idle_after(scraper, urls, 5.0)
        evaluated: list[float | None] = []
        for index, url in enumerate(urls):
            text = await _scrape(scraper, url)
            value = _number(_DEFERRED, text)
            if value is not None:
                deferred[index].append(value)
            evaluated.append(_number(_PROMPT_TOKENS, text))
    return summarise(answers, wall_s, workload, deferred, idle_s, evaluated)


def summarise(
    answers: list[Answer],
    wall_s: float,
    workload: Workload,
    deferred: list[list[float]],
    idle_s: float | None,
    evaluated: list[float | None],
) -> dict[str, Any]:
    good = [answer for answer in answers if answer.status == 200 and not answer.error]
    cached = sum(answer.cache_n for answer in good)
    prompt = sum(answer.cache_n + answer.prompt_n for answer in good)
    ttft = [answer.ttft_s * 1000 for answer in good if answer.ttft_s is not None]
    first = [a.cache_n + a.prompt_n for a in good if a.turn == 0]
    by_turn = {}
    for turn in range(workload.turns):
        these = [a for a in good if a.turn == turn]
        turn_prompt = sum(a.cache_n + a.prompt_n for a in these)
        by_turn[str(turn + 1)] = {
            "reused": round(sum(a.cache_n for a in these) / turn_prompt, 4)
            if turn_prompt
            else None,
            "ttft_p50_ms": _round(percentile([a.ttft_s * 1000 for a in these if a.ttft_s], 50)),
        }
    maxima = [max(samples) if samples else None for samples in deferred]
    known = [value for value in maxima if value is not None]
    return {
        "requests": len(answers),
        "expected": workload.conversations * workload.turns,
        "failed": len(answers) - len(good),
        "errors": sorted({answer.error for answer in answers if answer.error})[:3],
        "prompt_tokens": prompt,
        "prompt_tokens_reused": cached,
        "reused": round(cached / prompt, 4) if prompt else None,
        "first_turn_prompt_tokens_mean": round(statistics.mean(first), 1) if first else None,
        "ttft_p50_ms": _round(percentile(ttft, 50)),
        "ttft_p95_ms": _round(percentile(ttft, 95)),
        "total_s": round(wall_s, 2),
        "by_turn": by_turn,
        "requests_deferred_max": max(known) if known else None,
        "requests_deferred_max_per_engine": maxima,
        "deferral_samples": sum(len(samples) for samples in deferred),
        "all_idle_after_s": idle_s,
        "prompt_tokens_evaluated_per_engine": evaluated,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def cache(
    logs: Path,
    workload: Workload,
    engines: int,
    slots: int,
    ctx_size: int,
    swa_full: bool = True,
    contenders: tuple[str, ...] = CACHE_CONTENDERS,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """fleet-cache: the workload through each contender, on engines restarted for each.

    `swa_full` starts the engines with llama-server's `--swa-full`. gemma 3 attends over a
    sliding window, and without a full-size cache for those layers llama.cpp reuses a slot's
    cache only when the new prompt extends all of it (a conversation's next turn on the slot
    that ran its last one); a shared system prompt under a different conversation is then
    evaluated again (measured: `cache_n` 0 with `f_keep` 0.85 in its log). With it, any
    common prefix is reused, which is what prefix affinity is for."""
    result: dict[str, Any] = {
        "swa_full": swa_full,
        "engines": engines,
        "slots_per_engine": slots,
        "ctx_per_slot": ctx_size // slots,
        "systems": workload.systems,
        "conversations": workload.conversations,
        "turns": workload.turns,
        "max_tokens": workload.max_tokens,
        "clients": workload.clients,
        "think_s": workload.think_s,
        "stagger_s": workload.stagger_s,
    }
    for name in contenders:
        if name.startswith("nginx") and nginx_binary() is None:
            if notes is not None:
                notes.append("nginx is not installed: fleet-cache runs without nginx least_conn")
            continue
        try:
            result[name] = _cache_one(logs, workload, engines, slots, ctx_size, swa_full, name)
        except Exception as exc:  # one contender's failure is recorded, the others still run
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return result


def _cache_one(
    logs: Path,
    workload: Workload,
    count: int,
    slots: int,
    ctx_size: int,
    swa_full: bool,
    name: str,
) -> dict[str, Any]:
    engines = start_engines(logs, count, slots, ctx_size, name, swa_full)
    try:
        # The gate sits on the client's core, as in scenario 6.
        if name.startswith("nginx"):
            ports = [server.port for server in engines.servers]
            gate = start_nginx(ports, logs, "least_conn", CLIENT_CORE, name)
        else:
            gate = start_slotgate(name, ",".join(engines.urls), logs, _env(name), core=CLIENT_CORE)
        try:
            found = run_loop(measure(f"http://127.0.0.1:{gate.port}", engines.urls, workload))
            if name.startswith("slotgate"):
                found["routed"] = routed(gate.port)
        finally:
            gate.stop()
    finally:
        engines.stop()
    return found


def _env(name: str) -> dict[str, str]:
    """slotgate's settings for a fleet-cache contender's name."""
    routing, _, epsilon = name.removeprefix("slotgate-").partition("-eps=")
    env = {"ROUTING": routing}
    if epsilon:
        env["ROUTING_EPSILON"] = epsilon
    return env


def routed(port: int) -> dict[str, float]:
    """slotgate's requests routed, summed over its upstreams, by reason (affinity, load...)."""
    _, text = loadgen.http_json(port, "/metrics")
    counts: dict[str, float] = {}
    for reason, value in _ROUTED.findall(str(text)):
        counts[reason] = counts.get(reason, 0.0) + float(value)
    return counts


# -- routing cost ---------------------------------------------------------------------------------


@contextlib.contextmanager
def standins(logs: Path, count: int, name: str) -> Iterator[list[int]]:
    """One stand-in process serving `count` upstream ports; their ports."""
    server = start_standin(logs, extra_ports=count - 1, name=name)
    try:
        yield [server.port, *server.extra_ports]
    finally:
        server.stop()


def _urls(ports: list[int]) -> str:
    return ",".join(f"http://127.0.0.1:{port}" for port in ports)


def cost(
    logs: Path, upstreams: int, slots: int, clients: int, duration_s: float, rounds: int
) -> dict[str, Any]:
    """fleet-cost: slotgate's CPU per non-streamed request in front of 1 upstream of `slots`
    slots and of `upstreams` upstreams of `slots / upstreams` each, saturated by `clients` at
    once and then at one offered rate; the two gates run side by side and take turns, `rounds`
    times (medians reported)."""
    per = max(1, slots // upstreams)
    result: dict[str, Any] = {
        "upstreams": upstreams,
        "slots": slots,
        "clients": clients,
        "seconds": duration_s,
        "rounds": rounds,
    }
    with standins(logs, 1 + upstreams, "standin-fleet-cost") as ports:
        configure = {"tokens": 16, "token_delay_s": 0, "hold_s": 0, "record_gaps": False}
        loadgen.http_json(ports[0], "/_bench/config", {**configure, "slots": slots})
        for port in ports[1:]:
            loadgen.http_json(port, "/_bench/config", {**configure, "slots": per})
        for mode, routing in (("no key", "least-loaded"), ("keyed", "affinity")):
            gates: dict[int, Server] = {}
            try:
                for count, some in ((1, ports[:1]), (upstreams, ports[1:])):
                    gates[count] = start_slotgate(
                        f"slotgate-cost-{count}-{routing}", _urls(some), logs, {"ROUTING": routing}
                    )
                result[mode] = _cost_rounds(gates, mode == "keyed", clients, duration_s, rounds)
            finally:
                for gate in gates.values():
                    gate.stop()
            result[mode]["routing"] = routing
    return result


#: fleet-cost compares the two gates at one offered rate, this share of the slower gate's
#: saturated rate in the same round: both then do the same work per second. Saturated (the
#: closed loop, also reported), the gate over 8 upstreams completes 5-15% fewer requests per
#: second, so fewer per wake-up of its event loop, and its CPU per request then measures less
#: batching as much as routing (2026-12-01: at 3,000 req/s both cost the same per request).
COST_OFFERED_SHARE = 0.7
#: Connections the open loop spreads its requests over (none was ever short at this rate).
COST_CONNECTIONS = 128


def _cost_rounds(
    gates: dict[int, Server], keyed: bool, clients: int, duration_s: float, rounds: int
) -> dict[str, Any]:
    saturated: dict[int, list[float]] = {count: [] for count in gates}
    offered: dict[int, list[float]] = {count: [] for count in gates}
    requests: dict[int, int] = dict.fromkeys(gates, 0)
    failures: dict[int, int] = dict.fromkeys(gates, 0)
    starved: dict[int, int] = dict.fromkeys(gates, 0)
    rates: list[float] = []
    plain = chat_body(stream=False)
    loads: dict[int, tuple[bytes, list[bytes]]] = {}
    for count, gate in gates.items():
        # A key per connection: the closed loop's clients and the open loop's connections.
        keys = max(clients, COST_CONNECTIONS) if keyed else 0
        bodies = [
            request_bytes(gate.port, CHAT, {**plain, "prompt_cache_key": f"client-{i}"})
            for i in range(keys)
        ]
        loads[count] = (request_bytes(gate.port, CHAT, plain), bodies)

    def measured(gate: Server, run: Any) -> tuple[float, int, int]:
        return gate.cpu_s(), run.statuses[200], run.errors + run.completed - run.statuses[200]

    for round_ in range(rounds):
        order = list(gates) if round_ % 2 == 0 else list(reversed(gates))
        throughput: dict[int, float] = {}
        for count in order:
            gate = gates[count]
            raw, bodies = loads[count]
            run_loop(closed_loop(gate.port, raw, clients, 1.0, bodies=bodies))
            before = gate.cpu_s()
            run = run_loop(closed_loop(gate.port, raw, clients, duration_s, bodies=bodies))
            after, ok, failed = measured(gate, run)
            requests[count] += ok
            failures[count] += failed
            throughput[count] = ok / duration_s
            if ok:
                saturated[count].append((after - before) / ok * 1000)
        rate = COST_OFFERED_SHARE * min(throughput.values())
        rates.append(round(rate))
        for count in order:
            gate = gates[count]
            raw, bodies = loads[count]
            before = gate.cpu_s()
            run, short = run_loop(
                loadgen.open_loop(gate.port, raw, COST_CONNECTIONS, rate, duration_s, bodies)
            )
            after, ok, failed = measured(gate, run)
            requests[count] += ok
            failures[count] += failed
            starved[count] += short
            if ok:
                offered[count].append((after - before) / ok * 1000)
    one, many = sorted(gates)

    def summary(per_request: dict[int, list[float]]) -> dict[str, Any]:
        medians = {count: statistics.median(values) if values else None
                   for count, values in per_request.items()}  # fmt: skip
        return {
            "cpu_ms_per_request": {str(count): _round4(value) for count, value in medians.items()},
            "cpu_ms_per_request_by_round": {
                str(count): [round(value, 4) for value in values]
                for count, values in per_request.items()
            },
            "ratio": ratio(medians[many], medians[one]),
        }

    return {
        # The target's figures: both gates at one offered rate.
        **summary(offered),
        "offered_rate_per_s": rates,
        "starved": {str(count): value for count, value in starved.items()},
        "saturated": summary(saturated),
        "requests": {str(count): value for count, value in requests.items()},
        "failures": {str(count): value for count, value in failures.items()},
    }


def _round4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# -- balance --------------------------------------------------------------------------------------


def balance(
    logs: Path, slots: tuple[int, ...], hold_s: float, load: float, duration_s: float
) -> dict[str, Any]:
    """fleet-balance: upstreams of `slots` slots, generations of `hold_s`, an open loop offering
    `load` of the fleet's capacity with no affinity key (`ROUTING=least-loaded`); each
    upstream's share of the busy time (the stand-ins' own integral of running generations)
    against its share of the slots."""
    capacity = sum(slots)
    rate = load * capacity / hold_s
    result: dict[str, Any] = {
        "slots": list(slots),
        "generation_s": hold_s,
        "offered_load": load,
        "offered_per_s": round(rate, 1),
        "seconds": duration_s,
        "routing": "least-loaded",
    }
    with standins(logs, len(slots), "standin-fleet-balance") as ports:
        for port, count in zip(ports, slots, strict=True):
            loadgen.http_json(
                port,
                "/_bench/config",
                {"slots": count, "tokens": 16, "token_delay_s": 0, "hold_s": hold_s},
            )
        gate = start_slotgate(
            "slotgate-balance", _urls(ports), logs, {"ROUTING": "least-loaded", "MAX_QUEUE": "0"}
        )
        try:
            raw = request_bytes(gate.port, CHAT, chat_body(stream=False))
            connections = max(4 * capacity, 16)
            run_loop(loadgen.open_loop(gate.port, raw, connections, rate, 1.0))
            for port in ports:
                loadgen.http_json(port, "/_bench/config", {})  # resets the counters
            run, starved = run_loop(
                loadgen.open_loop(gate.port, raw, connections, rate, duration_s)
            )
            stats = [_stats(port) for port in ports]
        finally:
            gate.stop()
    busy = [float(stat["busy_ns"]) for stat in stats]
    total_busy = sum(busy) or 1.0
    rows = []
    for count, stat, spent in zip(slots, stats, busy, strict=True):
        share = spent / total_busy
        rows.append(
            {
                "slots": count,
                "capacity_share": round(count / capacity, 4),
                "busy_share": round(share, 4),
                "deviation": round(share / (count / capacity) - 1, 4),
                "generations": stat["started"],
                "peak_running": stat["peak"],
            }
        )
    result.update(
        {
            "requests": run.completed,
            "statuses": {str(k): v for k, v in run.statuses.items()},
            "errors": run.errors,
            "client_starved": starved,
            "utilisation": round(total_busy / 1e9 / (capacity * duration_s), 3),
            "upstreams": rows,
            "max_abs_deviation": max(abs(row["deviation"]) for row in rows),
            "above_slots": sum(
                max(0, int(row["peak_running"]) - int(row["slots"])) for row in rows
            ),
        }
    )
    return result


def _stats(port: int) -> dict[str, Any]:
    _, stats = loadgen.http_json(port, "/_bench/stats")
    assert isinstance(stats, dict)
    return stats


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.fleet [bench flags]`: the fleet scenarios alone, into results/fleet."""
    from bench import run

    given = sys.argv[1:] if argv is None else argv
    defaults = ["--scenarios", ",".join(run.FLEET_SCENARIOS)]
    if not any(arg == "--out" or arg.startswith("--out=") for arg in given):
        defaults += ["--out", str(BENCH / "results" / "fleet")]
    return run.main([*defaults, *given])


if __name__ == "__main__":
    raise SystemExit(main())
