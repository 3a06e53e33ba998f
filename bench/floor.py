"""The floor under slotgate: uvicorn, configured as `slotgate` runs it, with an ASGI app that
does nothing a gate does.

- `--answer`: every request is answered at once with the stand-in's non-streamed completion,
  no upstream: what uvicorn alone costs per request (scenario 1's `uvicorn-bare`).
- otherwise every request is held open until its client leaves: what a waiting request costs
  in uvicorn alone (scenario 4). `GET /held` says how many are held.

Run it as `python -m bench.floor --port P [--answer]`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

from tests.support.standin import BENCH, StandIn

held = 0
_OK = [(b"content-type", b"application/json")]


async def _lifespan(receive: Any, send: Any) -> None:
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def hold(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global held
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["path"] in ("/readyz", "/held"):
        await send({"type": "http.response.start", "status": 200, "headers": _OK})
        await send({"type": "http.response.body", "body": json.dumps({"held": held}).encode()})
        return
    held += 1
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    finally:
        held -= 1


# The stand-in's own answer (16 tokens), without its HTTP head.
_COMPLETION = StandIn(**BENCH).answer("completion").split(b"\r\n\r\n", 1)[1]
_ANSWER_HEAD = [*_OK, (b"content-length", str(len(_COMPLETION)).encode())]


async def answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": _ANSWER_HEAD})
    await send({"type": "http.response.body", "body": _COMPLETION})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--answer", action="store_true", help="answer at once; hold otherwise")
    args = parser.parse_args()
    # The options app/cli.py gives uvicorn.
    uvicorn.run(
        answer if args.answer else hold, host="127.0.0.1", port=args.port, loop="uvloop",
        http="httptools", lifespan="on", access_log=False, server_header=False,
        proxy_headers=False, log_level="warning",
    )  # fmt: skip


if __name__ == "__main__":
    main()
