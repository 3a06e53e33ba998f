"""The KV-cache budget measured on llama.cpp (xllamacpp and the gemma package), 1 thread.

    python -m bench.budget accuracy   # the local bound and bytes/3 against llama.cpp's count
    python -m bench.budget cost       # per request: the local bound, and the exact count
    python -m bench.budget burst      # 4 x (335 + 80) tokens on 4 slots sharing 1024
    python -m bench.budget mixed      # long and short requests: direct, slots only, budget
    python -m bench.budget learn      # KV_BUDGET_TOKENS unset: the burst twice through slotgate

Each starts its own engine (4 slots, one unified cache) and prints what it measured.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import timeit
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import uvicorn
from slotgate.cli import uvicorn_config
from slotgate.engine.model import demo_model
from slotgate.engine.process import LocalEngine
from slotgate.intake.cost import estimate, local
from slotgate.intake.endpoints import ENDPOINTS
from slotgate.main import Service, create_app
from slotgate.settings import Settings

CHAT = ENDPOINTS["/v1/chat/completions"]
STORY = ("Write a short story about a lighthouse keeper. " * 40)[:1600]


def long(i: int) -> dict[str, Any]:
    """About 335 prompt tokens and exactly 80 to generate."""
    content = f"Request {i}. {STORY}"
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 80,
            "ignore_eos": True}  # fmt: skip


def short(i: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"Say hello number {i}."}],
            "max_tokens": 40, "ignore_eos": True}  # fmt: skip


def cases() -> dict[str, list[dict[str, str]]]:
    prose = "The quick brown fox jumps over the lazy dog while the committee debates. " * 8
    code = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n" * 5
    records = [{"id": i, "name": f"item-{i}", "price": i * 3.14, "tags": ["a"]} for i in range(30)]
    return {
        "English prose": [{"role": "user", "content": prose}],
        "Python code": [{"role": "user", "content": code}],
        "numbers": [{"role": "user", "content": " ".join(str(i * 7919) for i in range(120))}],
        "Japanese": [
            {"role": "user", "content": "今日は良い天気ですね。明日も晴れるといいのですが。" * 6}
        ],
        "JSON records": [{"role": "user", "content": json.dumps(records)}],
        "emoji and symbols": [{"role": "user", "content": "🙂🚀✨ naïve café — “q” ≠ ≈ ∑ " * 10}],
        "base64": [
            {"role": "user", "content": "QmFzZTY0IGlzIGEgZ3JvdXAgb2YgYmluYXJ5LXRvLXRleHQ" * 8}
        ],
        "3-turn chat, system": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi. What do you need?"},
            {"role": "user", "content": prose[:300]},
        ],
    }


@asynccontextmanager
async def engine_and_gates(**budgets: int) -> AsyncIterator[tuple[str, dict[str, Service | str]]]:
    """A unified 4 x 1024 engine, and slotgate in front of it once per named budget."""
    engine = LocalEngine(demo_model(), parallel=4, ctx_size=1024, threads=1, kv_unified=True)
    engine.start()
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []
    urls: dict[str, Service | str] = {}
    try:
        for name, budget in budgets.items():
            settings = Settings(_env_file=None, llama_server_url=engine.url,
                                kv_budget_tokens=budget if budget >= 0 else None,
                                log_level="error",
                                keepalive_interval_s=0, host="127.0.0.1", port=0)  # fmt: skip
            app = create_app(settings)
            server = uvicorn.Server(uvicorn_config(app, settings))
            task = asyncio.create_task(server.serve())
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no event for it
                await asyncio.sleep(0.01)
            gate: Service = app.state.service
            while not gate.upstream.ready:  # noqa: ASYNC110 - nor does the props follower
                await asyncio.sleep(0.05)
            port = server.servers[0].sockets[0].getsockname()[1]
            urls[name] = f"http://127.0.0.1:{port}"
            urls[name + ":gate"] = gate
            servers.append((server, task))
        yield engine.url, urls
    finally:
        for server, task in servers:
            server.should_exit = True
            await task
        engine.stop()


async def accuracy() -> None:
    async with engine_and_gates() as (url, _), httpx.AsyncClient(timeout=120) as client:
        print("| prompt | usage.prompt_tokens | exact | local bound | bytes/3 |")
        for name, messages in cases().items():
            body = {"messages": messages, "max_tokens": 1}
            usage = (await client.post(url + "/v1/chat/completions", json=body)).json()["usage"]
            prompt = (await client.post(url + "/apply-template", json=body)).json()["prompt"]
            tokens = (
                await client.post(
                    url + "/tokenize",
                    json={"content": prompt, "add_special": True, "parse_special": True},
                )
            ).json()["tokens"]
            bound = estimate(CHAT, body).prompt
            third = len(orjson.dumps(messages)) // 3
            n = usage["prompt_tokens"]
            print(f"| {name} | {n} | {len(tokens)} | {bound} ({bound / n:.2f}x) | {third} "
                  f"({third / n:.2f}x) |")  # fmt: skip


async def cost() -> None:
    raw = orjson.dumps(long(1))
    n = 20000
    per = timeit.timeit(lambda: local(CHAT, orjson.loads(raw), 1024), number=n) / n
    print(f"local bound (JSON parse included), 335-token chat: {per * 1e6:.1f} us a request")
    async with engine_and_gates(budget=1024) as (_, gates):
        gate = gates["budget:gate"]
        assert isinstance(gate, Service)
        upstream = gate.upstream
        times = []
        for _ in range(100):
            started = time.perf_counter()
            await upstream.count_prompt(True, long(1))
            times.append(time.perf_counter() - started)
        times.sort()
        print(
            f"exact count (/apply-template + /tokenize, slotgate's pool, idle llama.cpp): "
            f"median {statistics.median(times) * 1e3:.2f} ms, p90 {times[89] * 1e3:.2f} ms"
        )


async def burst() -> None:
    async with engine_and_gates(budget=1024) as (url, gates), httpx.AsyncClient(timeout=300) as c:
        for name, target in (("direct", url), ("slotgate", gates["budget"])):
            await asyncio.sleep(1)
            print(name, await run(c, str(target), [long(i) for i in range(4)]))


async def mixed() -> None:
    mixes = {
        "4 long + 4 short": [long(i) for i in range(4)] + [short(i) for i in range(4)],
        "1 long + 7 short": [long(9)] + [short(i + 10) for i in range(7)],
    }
    async with (
        engine_and_gates(slots_only=0, budget=1024) as (url, gates),
        httpx.AsyncClient(timeout=600) as client,
    ):
        for mix, bodies in mixes.items():
            for name, target in (("direct", url), ("slots only", gates["slots_only"]),
                                 ("slots + budget", gates["budget"])):  # fmt: skip
                await asyncio.sleep(1)
                print(f"{mix} | {name} | {await run(client, str(target), bodies)}", flush=True)


async def learn() -> None:
    async with engine_and_gates(unset=-1) as (_, gates), httpx.AsyncClient(timeout=300) as client:
        gate = gates["unset:gate"]
        assert isinstance(gate, Service)
        for attempt in ("first", "second"):
            await asyncio.sleep(1)
            before = gate.admission.budget_tokens
            answer = await run(client, str(gates["unset"]), [long(i) for i in range(4)])
            print(f"{attempt} burst (budget {before}): {answer}")


async def run(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]]) -> str:
    started = time.monotonic()
    answers = await asyncio.gather(
        *(client.post(url + "/v1/chat/completions", json=body) for body in bodies)
    )
    elapsed = time.monotonic() - started
    ok = [a for a in answers if a.status_code == 200]
    exceeded = sum("Context size has been exceeded" in a.text for a in answers)
    generated = sum(a.json()["usage"]["completion_tokens"] for a in ok)
    return (f"{len(ok)}/{len(answers)} answered 200, {exceeded} x 500 context exceeded, "
            f"{elapsed:.1f} s, {generated / elapsed:.1f} generated tokens/s")  # fmt: skip


def main() -> None:
    steps = {"accuracy": accuracy, "cost": cost, "burst": burst, "mixed": mixed, "learn": learn}
    chosen = sys.argv[1:] or list(steps)
    for name in chosen:
        asyncio.run(steps[name]())


if __name__ == "__main__":
    main()
