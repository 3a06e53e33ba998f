"""What one relayed request costs slotgate, in counts rather than time: the Python functions
and the built-in calls slotgate's own code makes per request.

    python -m bench.experiments.request_calls [--requests 300] [--pythonpath DIR]

On a loaded machine a timing is noise; a count is not. Runs slotgate (uvicorn as `slotgate`
runs it) and the stand-in in this process, sends `--requests` chats of each kind (non-streamed,
streamed) one after another, and counts, under sys.setprofile, each call into a function of
slotgate's package and each built-in called from one, per request. `--pythonpath DIR` counts
another slotgate (DIR holds its `slotgate/` package), for before and after.

Measured for the metrics of time to first byte and duration, the operator controls' path
check and the cancel registry (against the tree before them): non-streamed 201 -> 203 Python
calls and 251 -> 256 built-in calls per request; streamed 182 -> 184 and 135 -> 140. The two
Python calls are the two histograms' `observe`; the five built-ins are their two bisections,
one clock read at the first byte, one tenant lookup and the path check for `/admin/`. Then a
request answered within 20 ms was never listed for cancelling; the registry now lists every
gated request at once, a dictionary's set and delete (bench/README.md, "Since then").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import slotgate
from slotgate.main import create_app
from slotgate.settings import Settings

from bench.experiments.upstreams import reexec_with, slotgate_origin
from tests.conftest import serve
from tests.support.standin import StandIn

_APP = str(Path(slotgate.__file__).resolve().parent)


class Counter:
    """Calls whose caller or callee is slotgate's code."""

    def __init__(self) -> None:
        self.python = 0
        self.builtin = 0
        self._ours: dict[str, bool] = {}

    def ours(self, filename: str) -> bool:
        known = self._ours.get(filename)
        if known is None:
            known = self._ours[filename] = str(Path(filename).resolve()).startswith(_APP)
        return known

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if self.ours(frame.f_code.co_filename):
                self.python += 1
        elif event == "c_call" and self.ours(frame.f_code.co_filename):
            self.builtin += 1


async def main(requests: int) -> None:
    standin = StandIn(total_slots=4, tokens=4, token_delay_s=0.0, record=False)
    await standin.start()
    settings = Settings(
        _env_file=None, llama_server_url=standin.url, keepalive_interval_s=0, log_level="warning"
    )
    gate = await serve(settings, create_app(settings))
    await gate.until(lambda: gate.service.upstream.ready)
    limits = httpx.Limits(max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=gate.url, limits=limits, timeout=30) as client:
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream}
            for _ in range(20):  # warm: caches, the first answer's lessons
                await client.post("/v1/chat/completions", json=body)
            counter = Counter()
            sys.setprofile(counter)
            try:
                for _ in range(requests):
                    await client.post("/v1/chat/completions", json=body)
            finally:
                sys.setprofile(None)
            kind = "streamed" if stream else "non-streamed"
            print(
                f"{kind}: {counter.python / requests:.1f} Python calls and "
                f"{counter.builtin / requests:.1f} built-in calls of slotgate's per request"
            )
    await gate.stop()
    await standin.stop()
    print(f"slotgate from: {slotgate_origin()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pythonpath", help="count the slotgate found here (before/after)")
    args = parser.parse_args()
    reexec_with(args.pythonpath, "bench.experiments.request_calls")
    asyncio.run(main(args.requests))
