"""A burst of clients through slotgate with each SDK's default retries: how many succeed.

    python -m bench.experiments.sdk_burst [--sdk openai,anthropic,node] [--burst 8]
        [--stream] [--max-tokens 20] [--env STREAM_HEAD_AFTER_S=0] [--pythonpath DIR]
        [--upstream standin|engine|URL]

Issue 17, points 1 and 2: a cold gate's Retry-After estimate and a streamed request's early
200 head decide whether an SDK's own retries rescue a burst. Each SDK fires `--burst` chat
requests at once (Anthropic: /v1/messages streams) at a fresh slotgate in front of 2 slots,
with its default retry policy, and the line as `--env` sets it (for instance `MAX_QUEUE=0`
to refuse whoever finds the slots busy, `STREAM_HEAD_AFTER_S=0` for the head at once, as before
issue 17). Prints, per SDK, how many succeeded, the failures, every `retry-after-ms` slotgate
sent and its hold estimate afterwards.

Upstreams: `standin` (tests/support/standin.py, 2 slots, `--max-tokens` tokens at 50 ms each),
`engine` (the real llama.cpp through slotgate's own `--demo` engine: xllamacpp and the gemma3
270M package, 2 slots, 1 thread) or the URL of a llama-server already running. The Node SDK
runs when `node` and `npm` exist and `npm install openai` works in a temporary folder
(removed afterwards); otherwise it says it skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from bench.experiments.upstreams import env_pairs, start_gate, start_standin
from bench.procs import Server

PROMPT: Any = [{"role": "user", "content": "Count from one to one thousand, one number per line."}]
SDKS = ("openai", "anthropic", "node")

_NODE_BURST = """
import OpenAI from "openai";
const [url, n, maxTokens, stream] = [process.argv[2], Number(process.argv[3]),
  Number(process.argv[4]), process.argv[5] === "stream"];
const sdk = new OpenAI({ baseURL: url + "/v1", apiKey: "x", timeout: 120000 });
const messages = [
  { role: "user", content: "Count from one to one thousand, one number per line." }];
async function call() {
  try {
    const answer = await sdk.chat.completions.create(
      { model: "m", messages, max_tokens: maxTokens, stream, ignore_eos: true });
    if (stream) { for await (const _ of answer) {} }
    return "ok";
  } catch (e) {
    return `${e.constructor.name} status=${e.status}`;
  }
}
console.log(JSON.stringify(await Promise.all(Array.from({ length: n }, call))));
"""


class Burst:
    """One burst's outcomes and the retry-after-ms values the SDK was sent."""

    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.retry_after_ms: list[int] = []

    async def seen(self, response: Any) -> None:
        if "retry-after-ms" in response.headers:
            self.retry_after_ms.append(int(response.headers["retry-after-ms"]))


async def _run(call: Callable[[], Awaitable[None]], burst: Burst, error: type[Exception]) -> None:
    try:
        await call()
        burst.outcomes.append("ok")
    except error as exc:
        status = getattr(exc, "status_code", None)
        name = type(exc).__name__
        burst.outcomes.append(f"{name} {status}" if status is not None else name)


async def openai_burst(url: str, args: argparse.Namespace) -> Burst:
    import openai

    burst = Burst()
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=120)
    sdk._client.event_hooks["response"].append(burst.seen)
    extra = {"ignore_eos": True}

    async def call() -> None:
        if args.stream:
            stream = await sdk.chat.completions.create(
                model="m", messages=PROMPT, max_tokens=args.max_tokens, stream=True,
                extra_body=extra,
            )  # fmt: skip
            async for _ in stream:
                pass
        else:
            await sdk.chat.completions.create(
                model="m", messages=PROMPT, max_tokens=args.max_tokens, extra_body=extra
            )

    await asyncio.gather(*(_run(call, burst, openai.APIError) for _ in range(args.burst)))
    await sdk.close()
    return burst


async def anthropic_burst(url: str, args: argparse.Namespace) -> Burst | str:
    try:
        import anthropic
    except ImportError:
        return "skipped: the anthropic package is not installed (pip install anthropic)"
    burst = Burst()
    sdk = anthropic.AsyncAnthropic(base_url=url, api_key="x", timeout=120)
    # Its own httpx (anthropic 2.x ships `httpx2`): hook the client it made.
    sdk._client.event_hooks["response"].append(burst.seen)

    async def call() -> None:
        async with sdk.messages.stream(
            model="m", max_tokens=args.max_tokens, messages=PROMPT,
            extra_body={"ignore_eos": True},
        ) as stream:  # fmt: skip
            async for _ in stream:
                pass

    await asyncio.gather(*(_run(call, burst, anthropic.APIError) for _ in range(args.burst)))
    await sdk.close()
    return burst


def node_folder() -> tuple[Path | None, str]:
    """A temporary folder with `openai` installed by npm, or None and why not."""
    if not (shutil.which("node") and shutil.which("npm")):
        return None, "skipped: node or npm is not installed"
    folder = Path(tempfile.mkdtemp(prefix="slotgate-node-"))
    done = subprocess.run(
        ["npm", "install", "--silent", "--no-audit", "--no-fund", "openai"],
        cwd=folder, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        return None, f"skipped: npm install openai failed: {done.stderr.strip()[-200:]}"
    (folder / "burst.mjs").write_text(_NODE_BURST)
    return folder, ""


async def node_burst(url: str, args: argparse.Namespace, folder: Path) -> Burst:
    burst = Burst()
    command = [
        "node", "burst.mjs", url, str(args.burst), str(args.max_tokens),
        "stream" if args.stream else "plain",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, cwd=folder, stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(args.timeout_s):
        out, _ = await process.communicate()
    burst.outcomes = json.loads(out.decode().strip().splitlines()[-1])
    return burst


def hold_estimate_s(url: str) -> str:
    """slotgate's hold estimate from its /metrics, when it publishes one."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("slotgate_slot_hold_estimate_seconds"):
            return f"{float(line.split()[-1]):.2f} s"
    return "not published"


def upstream(args: argparse.Namespace) -> tuple[str, Callable[[], None]]:
    if args.upstream == "standin":
        standin: Server = start_standin(total_slots=2, tokens=args.max_tokens, token_delay_s=0.05)
        return f"http://127.0.0.1:{standin.port}", standin.stop
    if args.upstream == "engine":
        from slotgate.engine.process import LocalEngine

        engine = LocalEngine.from_args(
            model=None, demo=True, parallel=2, ctx_size=2048, threads=1
        )  # fmt: skip
        engine.start()
        return engine.url, engine.stop
    return args.upstream.rstrip("/"), lambda: None


async def fire(sdk: str, url: str, args: argparse.Namespace, node: Path | None) -> Burst | str:
    if sdk == "openai":
        return await openai_burst(url, args)
    if sdk == "anthropic":
        return await anthropic_burst(url, args)
    if node is None:
        return "skipped"
    return await node_burst(url, args, node)


async def fire_watched(
    sdk: str, url: str, args: argparse.Namespace, node: Path | None
) -> tuple[Burst | str, float]:
    """`fire`, and the slot-seconds left idle while the burst still wanted them: from the
    first request to the last answer, every 50 ms, the slots /admission shows free while
    some client had not got its answer yet (the node SDK's: until the end of the burst)."""
    idle = 0.0
    done = asyncio.Event()

    async def sample(client: httpx.AsyncClient) -> None:
        nonlocal idle
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.05)
            now = time.monotonic()
            state = (await client.get(f"{url}/admission")).json()
            idle += state["free"] * (now - last)
            last = now

    async with httpx.AsyncClient(timeout=10) as client:
        sampler = asyncio.create_task(sample(client))
        try:
            burst = await fire(sdk, url, args, node)
        finally:
            done.set()
            await sampler
    return burst, idle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdk", default=",".join(SDKS), help="comma-separated: " + ", ".join(SDKS))
    parser.add_argument("--burst", type=int, default=8, help="clients at once")
    parser.add_argument("--stream", action="store_true", help="OpenAI SDKs stream too")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--upstream", default="standin", help="standin, engine or a URL")
    parser.add_argument("--env", action="append", default=[], help="slotgate's KEY=VALUE")
    parser.add_argument("--pythonpath", help="run the slotgate found here (before/after)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="bound on each burst")
    parser.add_argument(
        "--warm", type=int, default=0, help="requests one after another before the burst, so "
        "that the gate has seen real holds (default 0: a cold gate)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    sdks = [name for name in args.sdk.split(",") if name]
    if unknown := set(sdks) - set(SDKS):
        parser.error(f"unknown SDK: {', '.join(sorted(unknown))}")
    env = env_pairs(args.env)
    node, why = node_folder() if "node" in sdks else (None, "")
    url, stop_upstream = upstream(args)
    try:
        for sdk in sdks:
            # A fresh gate per SDK: each burst meets a cold estimate, as issue 17 saw it.
            gate = start_gate(url, env, args.pythonpath)
            gate_url = f"http://127.0.0.1:{gate.port}"
            try:
                for _ in range(args.warm):
                    httpx.post(
                        f"{gate_url}/v1/chat/completions",
                        json={"model": "m", "messages": PROMPT, "max_tokens": args.max_tokens},
                        timeout=120,
                    ).raise_for_status()
                started = time.monotonic()
                burst, idle = asyncio.run(
                    asyncio.wait_for(fire_watched(sdk, gate_url, args, node), args.timeout_s)
                )
                took = time.monotonic() - started
                if isinstance(burst, str):
                    print(f"{sdk}: {why or burst}", flush=True)
                    continue
                ok = burst.outcomes.count("ok")
                failed = sorted(o for o in burst.outcomes if o != "ok")
                sent = sorted(burst.retry_after_ms)
                seen = (
                    f"{len(sent)} ({len(set(sent))} distinct; min {sent[0]}, median "
                    f"{sent[len(sent) // 2]}, max {sent[-1]})"
                    if sent and sdk != "node"
                    else "none seen"
                )
                print(
                    f"{sdk}: {ok}/{args.burst} succeeded in {took:.1f} s; failures: "
                    f"{len(failed)} {sorted(set(failed))}; slot-seconds idle while wanted: "
                    f"{idle:.1f}; retry-after-ms sent: {seen}; "
                    f"hold estimate after: {hold_estimate_s(gate_url)}",
                    flush=True,
                )
            finally:
                gate.stop()
    finally:
        stop_upstream()
        if node is not None:
            shutil.rmtree(node, ignore_errors=True)
    print(f"env: {env}; slotgate from: {args.pythonpath or 'this checkout'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
