"""slotgate's memory before and after requests that meet a hostile upstream's huge answers.

    python -m bench.experiments.upstream_memory [--answer huge_head|huge_error]
        [--requests 5] [--pythonpath DIR]

Issue 13, point 5: a 20 MB response head once added about 300 MB of RSS each time, and a
200 MB error body was relayed into a waiting stream as one event. This starts
the hostile stand-in (`python -m tests.support.hostile --answer ...`, one slot) and
`python -m slotgate` in front of it, then sends `--requests` requests one after the other and
prints the gate process's VmRSS and VmHWM (peak) from /proc before and after each, with the
status and the bytes the client read (the whole answer, head included):
- `huge_head`: a non-streamed chat completion, answered with a 20 MB head;
- `huge_error`: a stream that holds the only slot for a second (`?hold`) and a second stream
  that waits behind it, its 200 head already out (`STREAM_HEAD_AFTER_S=0`), and then meets a
  200 MB error body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from bench.experiments.upstreams import start_gate, start_hostile

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def memory(pid: int) -> str:
    """VmRSS and VmHWM of `pid`, in MB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    if "VmRSS" not in values:
        return "process gone"
    return f"VmRSS {values['VmRSS']:.0f} MB, VmHWM {values['VmHWM']:.0f} MB"


async def post(port: int, target: str, body: dict[str, object]) -> tuple[int, int]:
    """POST on a fresh connection and read to its end, as curl would: (status, bytes read).

    A raw socket: an HTTP client library would refuse a 20 MB head before counting it.
    """
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        first = await reader.readline()
        received = len(first)
        while chunk := await reader.read(1 << 20):
            received += len(chunk)
    finally:
        writer.close()
    parts = first.split()
    return (int(parts[1]) if len(parts) > 1 else 0), received


async def huge_head(port: int) -> str:
    status, received = await post(port, CHAT, {**BODY, "stream": False})
    return f"status {status}, {received:,} bytes"


async def huge_error(port: int) -> str:
    holder = asyncio.create_task(post(port, CHAT + "?hold", BODY))
    await asyncio.sleep(0.3)  # the holder has the only slot; the next one waits
    status, received = await post(port, CHAT, BODY)
    await holder
    return f"waiting stream: status {status}, {received:,} bytes"


async def run(port: int, pid: int, answer: str, requests: int) -> None:
    send = huge_head if answer == "huge_head" else huge_error
    await asyncio.sleep(1.0)
    print(f"before: {memory(pid)}", flush=True)
    for number in range(1, requests + 1):
        outcome = await send(port)
        print(f"after request {number} ({outcome}): {memory(pid)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answer", choices=("huge_head", "huge_error"), default="huge_head")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--pythonpath", help="run the slotgate found here (before/after)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on the whole run")
    args = parser.parse_args(argv)
    hostile = start_hostile(args.answer, total_slots=1, hold_s=1.0)
    try:
        env = {
            "PROPS_REFRESH_INTERVAL_S": "60",
            "KEEPALIVE_INTERVAL_S": "0.5",
            "STREAM_HEAD_AFTER_S": "0",
        }
        gate = start_gate(f"http://127.0.0.1:{hostile.port}", env, args.pythonpath)
        try:
            coroutine = run(gate.port, gate.process.pid, args.answer, args.requests)
            asyncio.run(asyncio.wait_for(coroutine, args.timeout_s))
        finally:
            gate.stop()
    finally:
        hostile.stop()
    print(f"answer: {args.answer}; slotgate from: {args.pythonpath or 'this checkout'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
