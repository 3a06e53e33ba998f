"""Whether Retry-After stays an estimate when clients come back early, late or together.

    python -m bench.experiments.retry_estimates [cold|impatient|both] [--burst 40]
        [--late-burst 12] [--impatient 12] [--impatient-s 8] [--hold-tokens 36]
        [--pythonpath DIR]

Both scenarios run a fresh slotgate in front of the stand-in (2 slots, `--hold-tokens` tokens
at 50 ms each: 1.8 s holds) with `MAX_QUEUE=2`, and clients through the OpenAI Python SDK with
its default retries (twice, as `retry-after-ms` says).

- `cold`: `--burst` requests at once at the cold gate. Prints how many were served, the
  `retry-after-ms` values sent at each attempt, and the slot-seconds left idle while some
  client still wanted a slot.
- `impatient`: `--impatient` clients send requests for `--impatient-s` seconds, each retrying
  a refusal after 0.5 s whatever Retry-After said; once the pool is idle, `--late-burst` SDK
  clients at once. Prints, in the order they were refused, each late client's first estimate
  beside the wait it then saw (from that refusal until its answer began, less one hold) and
  beside what the line implied (the k-th refused gets the k-th place to free: k/2 holds on
  2 slots), then the burst's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import httpx

from bench.experiments.sdk_burst import PROMPT
from bench.experiments.upstreams import start_gate, start_standin

TOKEN_DELAY_S = 0.05


class Watch:
    """What the SDK's client saw of each request, by the x-bench-id header the call sends."""

    def __init__(self) -> None:
        self.refusals: dict[str, list[tuple[float, float]]] = {}  # id -> (when, told s)
        self.answered: dict[str, float] = {}

    async def seen(self, response: httpx.Response) -> None:
        key = response.request.headers.get("x-bench-id", "?")
        now = time.monotonic()
        if response.status_code == 429:
            told = int(response.headers.get("retry-after-ms", "0")) / 1000
            self.refusals.setdefault(key, []).append((now, told))
        elif response.status_code == 200:
            self.answered[key] = now


async def _sdk_burst(url: str, count: int, tokens: int, watch: Watch) -> list[str]:
    import openai

    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=120)
    sdk._client.event_hooks["response"].append(watch.seen)

    async def call(i: int) -> str:
        try:
            await sdk.chat.completions.create(
                model="m", messages=PROMPT, max_tokens=tokens,
                extra_body={"ignore_eos": True}, extra_headers={"x-bench-id": str(i)},
            )  # fmt: skip
        except openai.APIError as exc:
            return f"{type(exc).__name__} {getattr(exc, 'status_code', '')}".strip()
        return "ok"

    try:
        return list(await asyncio.gather(*(call(i) for i in range(count))))
    finally:
        await sdk.close()


async def _idle_while(url: str, until: asyncio.Event) -> float:
    """Slot-seconds /admission shows free, every 50 ms, until `until` is set."""
    idle = 0.0
    async with httpx.AsyncClient(timeout=10) as client:
        last = time.monotonic()
        while not until.is_set():
            await asyncio.sleep(0.05)
            state = (await client.get(f"{url}/admission")).json()
            now = time.monotonic()
            idle += state["free"] * (now - last)
            last = now
    return idle


async def _watched_burst(
    url: str, count: int, tokens: int
) -> tuple[list[str], Watch, float, float]:
    watch = Watch()
    done = asyncio.Event()
    sampler = asyncio.create_task(_idle_while(url, done))
    started = time.monotonic()
    try:
        outcomes = await _sdk_burst(url, count, tokens, watch)
    finally:
        took = time.monotonic() - started
        done.set()
        idle = await sampler
    return outcomes, watch, took, idle


def cold(url: str, args: argparse.Namespace) -> None:
    outcomes, watch, took, idle = asyncio.run(_watched_burst(url, args.burst, args.hold_tokens))
    by_attempt: list[list[float]] = [[], [], []]
    for told in watch.refusals.values():
        for k, (_, seconds) in enumerate(told[:3]):
            by_attempt[k].append(seconds)
    failed = sorted({o for o in outcomes if o != "ok"})
    print(
        f"cold: {outcomes.count('ok')}/{args.burst} served in {took:.1f} s; failures: "
        f"{len(outcomes) - outcomes.count('ok')} {failed}; slot-seconds idle while wanted: "
        f"{idle:.1f}",
        flush=True,
    )
    for k, told in enumerate(by_attempt):
        if told:
            told.sort()
            print(
                f"  refusal {k + 1}: {len(told)} told {told[0]:.1f}-{told[-1]:.1f} s "
                f"(median {told[len(told) // 2]:.1f})",
                flush=True,
            )


async def _impatient(url: str, clients: int, seconds: float, tokens: int) -> tuple[int, int]:
    served = refused = 0
    stop = time.monotonic() + seconds
    body = {"model": "m", "messages": PROMPT, "max_tokens": tokens, "ignore_eos": True}

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal served, refused
        while time.monotonic() < stop:
            answer = await http.post(f"{url}/v1/chat/completions", json=body)
            if answer.status_code == 429:
                refused += 1
                await asyncio.sleep(0.5)  # whatever Retry-After said
            else:
                served += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return served, refused


async def _until_idle(url: str) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            state = (await client.get(f"{url}/admission")).json()
            if not state["active"] and not state["queued"]:
                return
            await asyncio.sleep(0.05)


def impatient(url: str, args: argparse.Namespace) -> None:
    hold_s = args.hold_tokens * TOKEN_DELAY_S
    served, refused = asyncio.run(
        _impatient(url, args.impatient, args.impatient_s, args.hold_tokens)
    )
    asyncio.run(_until_idle(url))
    said = httpx.get(f"{url}/admission", timeout=10).json().get("retry_after_estimate_s")
    print(
        f"impatient: {args.impatient} clients for {args.impatient_s:.0f} s: {served} served, "
        f"{refused} refused; the pool idle, /admission says retry_after_estimate_s={said}",
        flush=True,
    )
    outcomes, watch, took, idle = asyncio.run(
        _watched_burst(url, args.late_burst, args.hold_tokens)
    )
    firsts = sorted((told[0][0], told[0][1], key) for key, told in watch.refusals.items() if told)
    worst = apart = 0.0
    for k, (when, estimate, key) in enumerate(firsts, start=1):
        answered = watch.answered.get(key)
        waited = "never" if answered is None else f"{answered - hold_s - when:5.1f} s"
        if answered is not None and estimate > 0:
            wait_s = answered - hold_s - when
            apart = max(apart, wait_s / estimate, estimate / wait_s if wait_s > 0 else 0.0)
        implied = (k + 1) // 2 * hold_s  # the k-th place to free on 2 slots
        worst = max(worst, estimate / implied if implied else 0.0)
        print(
            f"  refused #{k:2d}: told {estimate:5.1f} s, waited {waited}, the line implied "
            f"{implied:4.1f} s",
            flush=True,
        )
    print(
        f"late burst: {outcomes.count('ok')}/{args.late_burst} served in {took:.1f} s "
        f"(a fresh gate: about {args.late_burst / 2 * hold_s:.1f} s of holds); slot-seconds "
        f"idle while wanted: {idle:.1f}; worst estimate / line's implied wait: {worst:.2f}; "
        f"estimate and wait seen at most {apart:.2f}x apart",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "scenario", nargs="?", default="both", choices=("cold", "impatient", "both")
    )
    parser.add_argument("--burst", type=int, default=40, help="the cold burst's clients")
    parser.add_argument("--late-burst", type=int, default=12, help="the burst after")
    parser.add_argument("--impatient", type=int, default=12, help="clients ignoring Retry-After")
    parser.add_argument("--impatient-s", type=float, default=8.0)
    parser.add_argument("--hold-tokens", type=int, default=36, help="x 50 ms: the hold")
    parser.add_argument("--pythonpath", help="run the slotgate found here (before/after)")
    args = parser.parse_args(argv)
    env = {"MAX_QUEUE": "2", "LOG_LEVEL": "warning"}
    standin = start_standin(total_slots=2, tokens=args.hold_tokens, token_delay_s=TOKEN_DELAY_S)
    upstream = f"http://127.0.0.1:{standin.port}"
    scenarios: list[Any] = {"cold": [cold], "impatient": [impatient]}.get(
        args.scenario, [cold, impatient]
    )
    try:
        for scenario in scenarios:
            gate = start_gate(upstream, env, args.pythonpath)
            try:
                scenario(f"http://127.0.0.1:{gate.port}", args)
            finally:
                gate.stop()
    finally:
        standin.stop()
    print(f"slotgate from: {args.pythonpath or 'this checkout'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
