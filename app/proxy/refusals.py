"""A refusal (app/errors.py) as the bytes of an HTTP answer, in the shape the client's API speaks.

OpenAI routes get `{"error": {"message", "type", "code", "param"}}`; Anthropic's
`/v1/messages` gets `{"type": "error", "error": {"type", "message"}}`. Both carry the pool's
snapshot under `admission` when the refusal came from the gate, and a Retry-After when a retry
can succeed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from slotgate.asgi import Headers
from slotgate.errors import Flavor, Refusal, anthropic_type, whole_seconds

if TYPE_CHECKING:
    from slotgate.gate.pool import Snapshot


def admission_body(snapshot: Snapshot, retry_after_s: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "capacity": snapshot.capacity,
        "active": snapshot.active,
        "queued": snapshot.queued,
        "free": snapshot.free,
        "queue_limit": snapshot.queue_limit,
    }
    if snapshot.budget_tokens is not None:
        body["budget_tokens"] = snapshot.budget_tokens
        body["committed_tokens"] = snapshot.committed_tokens
        body["free_tokens"] = snapshot.free_tokens
    if snapshot.tenant is not None:
        own = snapshot.tenant
        body["tenant"] = {"name": own.name, "active": own.active, "queued": own.queued}
    if retry_after_s is not None:
        body["retry_after_s"] = round(retry_after_s, 3)
    return body


def error_object(r: Refusal, flavor: Flavor) -> dict[str, Any]:
    if flavor == "anthropic":
        inner: dict[str, Any] = {
            "type": anthropic_type(r.type), "message": r.message, "code": r.code,
        }  # fmt: skip
    else:
        inner = {"message": r.message, "type": r.type, "code": r.code, "param": r.param}
    if r.extra is not None:
        inner.update(r.extra)
    if r.snapshot is not None:
        inner["admission"] = admission_body(r.snapshot, r.retry_after_s)
    if flavor == "anthropic":
        return {"type": "error", "error": inner}
    return {"error": inner}


def retry_headers(retry_after_s: float | None) -> Headers:
    """Retry-After in whole seconds, rounded half up to the nearest (at least 1), so that it
    is within half a second of retry-after-ms, which carries the estimate to the millisecond.
    """
    if retry_after_s is None:
        return []
    return [
        (b"retry-after", str(whole_seconds(retry_after_s)).encode()),
        (b"retry-after-ms", str(max(1, round(retry_after_s * 1000))).encode()),
        (b"x-should-retry", b"true"),
    ]


def render(r: Refusal, flavor: Flavor) -> tuple[int, Headers, bytes]:
    """Status, headers and body of a complete error answer."""
    body = orjson.dumps(error_object(r, flavor))
    headers: Headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *retry_headers(r.retry_after_s),
    ]
    if r.final:
        headers.append((b"x-should-retry", b"false"))
    return r.status, headers, body


def stream_event(r: Refusal, flavor: Flavor) -> bytes:
    """The same error as an SSE event, for a stream whose head has already gone out.

    The OpenAI shape mirrors llama-server's own in-stream error (`data: {"error": ...}`);
    Anthropic clients expect an `event: error` line.
    """
    payload = orjson.dumps(error_object(r, flavor)).decode()
    if flavor == "anthropic":
        return f"event: error\ndata: {payload}\n\n".encode()
    return f"data: {payload}\n\n".encode()
