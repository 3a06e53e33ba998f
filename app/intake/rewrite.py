"""The request body slotgate forwards in place of the client's: a non-streamed request asked of
llama-server as a stream (proxy/assembly.py puts its answer together again), written compactly.
"""

from __future__ import annotations

from typing import Any

import orjson


def streaming_body(body: bytes) -> bytes:
    """The request body asking llama-server for a stream, with usage in its last events."""
    return streaming_request(body)[0]


def streaming_request(body: bytes) -> tuple[bytes, dict[str, Any]]:
    """The body asking llama-server for a stream with usage in its last events (a
    non-streamed answer always has usage, whatever `stream_options` says), and the payload."""
    payload = orjson.loads(body)
    asked = dict(payload)
    asked["stream"] = True
    options = payload.get("stream_options")
    asked["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return dump(asked), payload


#: Up to this size a dump is copied out of orjson's buffer (see `dump`); a copy this small
#: costs less than a microsecond.
_COPY_BELOW_BYTES = 64 * 1024


def dump(value: Any) -> bytes:
    """`value` as JSON, in a buffer no larger than it."""
    out = orjson.dumps(value)
    # orjson hands back its whole write buffer, 4 KiB at the least, for a short output: a
    # rewritten request body that waits in the queue would hold that much for its few bytes
    # (measured: 4,089 B per waiter, half of slotgate's own share). Keep what was written.
    return bytes(memoryview(out)) if len(out) < _COPY_BELOW_BYTES else out
