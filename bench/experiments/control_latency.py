"""How soon an operator control acts: each control's HTTP call timed end to end, and a cancel
timed from its call to the end of the cancelled client's stream.

slotgate runs as its own process (keyless, so loopback calls are allowed) in front of a
stand-in llama-server with 2 slots whose generations last a minute. Per round: drain and
restore the upstream, pause and resume admission, and cancel a running stream, `--rounds`
times. A control acts before its answer is sent (the answer says what was done), so the
call's time bounds the time to act; the cancel's second figure is what its client sees.

Run it as `python -m bench.experiments.control_latency [--rounds 50]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.contenders import start_slotgate_over
from tests.support.standin import StandIn

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 2000}


def summary(name: str, times_ms: list[float]) -> str:
    ordered = sorted(times_ms)
    p99 = ordered[min(len(ordered) - 1, round(len(ordered) * 0.99))]
    return f"| {name} | {statistics.median(ordered):.2f} | {p99:.2f} | {ordered[-1]:.2f} |"


async def timed(client: httpx.AsyncClient, path: str) -> float:
    start = time.perf_counter()
    answer = await client.post(path)
    assert answer.status_code == 200, answer.text
    return (time.perf_counter() - start) * 1000


async def cancel_one(client: httpx.AsyncClient, request_id: str) -> tuple[float, float]:
    """The cancel call's time and the time until the cancelled stream ended, in ms."""
    ended = asyncio.get_running_loop().create_future()
    started = asyncio.Event()

    async def stream() -> None:
        headers = {"x-request-id": request_id}
        async with client.stream(
            "POST", "/v1/chat/completions", json=CHAT, headers=headers
        ) as answer:
            async for _ in answer.aiter_raw():
                started.set()
        ended.set_result(time.perf_counter())

    streaming = asyncio.create_task(stream())
    await started.wait()
    start = time.perf_counter()
    call = await timed(client, f"/admin/requests/{request_id}/cancel")
    await asyncio.wait_for(asyncio.shield(ended), 10)
    await streaming
    return call, (ended.result() - start) * 1000


async def main(rounds: int) -> None:
    standin = StandIn(total_slots=2, tokens=1200, token_delay_s=0.05, record=False)
    await standin.start()
    times: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory() as logs:
            gate = await start_slotgate_over(standin.url, Path(logs))
            try:
                url = f"http://127.0.0.1:{gate.port}"
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    name = (await client.get("/admission")).json()["upstreams"][0]["name"]
                    for index in range(rounds):
                        for action, path in (
                            ("drain", f"/admin/upstreams/{name}/drain"),
                            ("restore", f"/admin/upstreams/{name}/restore"),
                            ("pause", "/admin/pause"),
                            ("resume", "/admin/resume"),
                        ):
                            times.setdefault(action, []).append(await timed(client, path))
                        call, ended = await cancel_one(client, f"bench-{index}")
                        times.setdefault("cancel (call)", []).append(call)
                        times.setdefault("cancel (client's stream ended)", []).append(ended)
            finally:
                gate.stop()
    finally:
        await standin.stop()
    print(f"{rounds} rounds; times in ms")
    print("| control | p50 | p99 | max |")
    print("|---|---|---|---|")
    for action, measured in times.items():
        print(summary(action, measured))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.rounds))
