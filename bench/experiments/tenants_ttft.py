"""An interactive client's time to first token beside another key's flood: fair share and FIFO.

    python -m bench.experiments.tenants_ttft [--upstream standin|engine|URL] [--flood 30]
        [--chats 8] [--max-tokens 20] [--modes fair,fifo] [--pythonpath DIR]

Issue 19: two OpenAI SDK clients through one slotgate in front of 2 slots. The flood keeps
`--flood` streamed requests in flight (`max_retries=0`, each sent again as soon as it ends);
once the line is full of them, the interactive client sends `--chats` streamed requests one
after another (a second apart) and times each one's first content chunk. `fair`: the two use
different keys (API_KEYS), so they are two tenants; `fifo`: they share one key, one tenant, so
one FIFO line, as slotgate was before tenants (and still is without keys). Prints, per mode,
the interactive client's time to first token (p50, max) and how many flood requests ended
meanwhile.

Upstreams: `standin` (tests/support/standin.py, 2 slots, `--max-tokens` tokens at 50 ms each),
`engine` (the real llama.cpp through slotgate's own `--demo` engine: xllamacpp and the gemma3
270M package, 2 slots, 1 thread) or the URL of a llama-server already running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.experiments.upstreams import start_gate, start_standin
from bench.procs import Server

PROMPT: Any = [{"role": "user", "content": "Count from one to one thousand, one number per line."}]


def upstream(args: argparse.Namespace) -> tuple[str, Callable[[], None]]:
    if args.upstream == "standin":
        standin: Server = start_standin(total_slots=2, tokens=args.max_tokens, token_delay_s=0.05)
        return f"http://127.0.0.1:{standin.port}", standin.stop
    if args.upstream == "engine":
        from slotgate.engine.process import LocalEngine

        engine = LocalEngine.from_args(model=None, demo=True, parallel=2, ctx_size=2048, threads=1)
        engine.start()
        return engine.url, engine.stop
    return args.upstream.rstrip("/"), lambda: None


async def run_mode(url: str, keys: tuple[str, str], args: argparse.Namespace) -> dict[str, Any]:
    import openai

    flood_sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys[0], max_retries=0)
    chat_sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=keys[1], timeout=300)
    extra = {"ignore_eos": True}
    stop = asyncio.Event()
    flood_done = 0
    flood_failed = 0

    async def flood_worker() -> None:
        nonlocal flood_done, flood_failed
        while not stop.is_set():
            try:
                stream = await flood_sdk.chat.completions.create(
                    model="m", messages=PROMPT, max_tokens=args.max_tokens, stream=True,
                    extra_body=extra,
                )  # fmt: skip
                async for _ in stream:
                    pass
                flood_done += 1
            except openai.APIError:
                flood_failed += 1
                await asyncio.sleep(0.2)

    async def first_token_s() -> float:
        started = time.monotonic()
        stream = await chat_sdk.chat.completions.create(
            model="m", messages=PROMPT, max_tokens=args.max_tokens, stream=True, extra_body=extra
        )
        first: float | None = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.monotonic() - started
        assert first is not None
        return first

    workers = [asyncio.create_task(flood_worker()) for _ in range(args.flood)]
    await asyncio.sleep(args.settle_s)  # the line fills with the flood
    before = flood_done
    ttft: list[float] = []
    try:
        for _ in range(args.chats):
            ttft.append(await first_token_s())
            await asyncio.sleep(1.0)
    finally:
        stop.set()
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await flood_sdk.close()
        await chat_sdk.close()
    return {
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_max_s": round(max(ttft), 3),
        "flood_served_meanwhile": flood_done - before,
        "flood_refused": flood_failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", default="standin", help="standin, engine or a URL")
    parser.add_argument("--flood", type=int, default=30, help="flood requests kept in flight")
    parser.add_argument("--chats", type=int, default=8, help="interactive requests, in turn")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--settle-s", type=float, default=3.0, help="flood alone before chats")
    parser.add_argument("--modes", default="fair,fifo")
    parser.add_argument("--pythonpath", help="run the slotgate found here")
    args = parser.parse_args()
    url, stop_upstream = upstream(args)
    results: dict[str, Any] = {}
    try:
        for mode in args.modes.split(","):
            keys = ("sk-flood", "sk-chat") if mode == "fair" else ("sk-shared", "sk-shared")
            env = {"API_KEYS": ",".join(sorted(set(keys))), "MAX_QUEUE": "0"}
            gate = start_gate(url, env, args.pythonpath)
            try:
                results[mode] = asyncio.run(run_mode(f"http://127.0.0.1:{gate.port}", keys, args))
            finally:
                gate.stop()
    finally:
        stop_upstream()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
