"""The memory floor under slotgate: uvicorn, configured as `slotgate` runs it, with an ASGI app
that only holds every request open until its client leaves.

Scenario 4 fills it with the same waiting requests as slotgate, so the report can tell what a
waiting request costs in uvicorn itself from what slotgate adds on top.

Run it as `python -m bench.floor --port P`.
"""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

held = 0


async def hold(scope: dict[str, Any], receive: Any, send: Any) -> None:
    global held
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] in ("/readyz", "/held"):
        body = b'{"held": %d}' % held
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})
        return
    held += 1
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    finally:
        held -= 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # The options app/cli.py gives uvicorn.
    uvicorn.run(
        hold, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools",
        lifespan="on", access_log=False, server_header=False, proxy_headers=False,
        log_level="warning",
    )  # fmt: skip


if __name__ == "__main__":
    main()
