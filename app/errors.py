"""The one place where a refusal becomes an HTTP answer, in the shape the client's API speaks.

OpenAI routes get `{"error": {"message", "type", "code", "param"}}`; Anthropic's
`/v1/messages` gets `{"type": "error", "error": {"type", "message"}}`. Both carry the pool's
snapshot under `admission` when the refusal came from the gate, and a Retry-After when a retry
can succeed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from slotgate.asgi import Headers
from slotgate.gate.admission import (
    AdmissionError,
    NotReady,
    QueueFull,
    QueueTimeout,
    ShuttingDown,
    TenantQueueFull,
    TenantTooLarge,
    TooLarge,
)
from slotgate.gate.pool import Snapshot

Flavor = Literal["openai", "anthropic"]


class GateError(Exception):
    """A request slotgate answers itself, without (or instead of) llama-server's answer."""

    status = 500
    type = "server_error"
    code = "internal_error"
    reason = "internal"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(GateError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    reason = "bad_request"


class Unauthorized(GateError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"
    reason = "unauthorized"


class PayloadTooLarge(GateError):
    status = 413
    type = "invalid_request_error"
    code = "body_too_large"
    reason = "bad_request"


class HeadersTooLarge(GateError):
    status = 431
    type = "invalid_request_error"
    code = "headers_too_large"
    reason = "bad_request"


class UnsupportedMediaType(GateError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"
    reason = "bad_request"


class UpstreamUnavailable(GateError):
    """llama-server cannot be reached or is not ready; a retry may succeed."""

    status = 503
    type = "unavailable_error"
    code = "upstream_unavailable"
    reason = "upstream_unavailable"


class UpstreamFailed(GateError):
    """llama-server broke off, stalled or answered something that is not HTTP."""

    status = 502
    type = "server_error"
    code = "upstream_failed"
    reason = "upstream_failed"


class QueueBytesFull(GateError):
    """The requests in the queue already hold QUEUE_BODY_BYTES of bodies; a retry may pass."""

    status = 429
    type = "rate_limit_error"
    code = "queue_bytes_full"
    reason = "queue_bytes_full"

    def __init__(self, message: str, snapshot: Snapshot, retry_after_s: float) -> None:
        super().__init__(message)
        self.snapshot = snapshot
        self.retry_after_s = retry_after_s


class ContextExceeded(GateError):
    """The prompt alone is longer than llama-server's KV cache: it could never run. Said in
    llama-server's own words and shape, before the request waits for anything."""

    status = 400
    type = "exceed_context_size_error"
    code = "exceed_context_size_error"
    reason = "bad_request"

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it"
        )
        self.extra = {"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Everything needed to write an error answer."""

    status: int
    type: str
    code: str
    message: str
    reason: str
    param: str | None = None
    retry_after_s: float | None = None
    snapshot: Snapshot | None = None
    extra: dict[str, Any] | None = None  # llama-server's own fields beside its error's


def refusal(exc: Exception) -> Refusal:
    """Classify a domain exception; anything unknown is a 500 whose text is not leaked."""
    if isinstance(exc, QueueBytesFull):
        return Refusal(
            exc.status, exc.type, exc.code, exc.message, exc.reason, None,
            exc.retry_after_s, exc.snapshot,
        )  # fmt: skip
    if isinstance(exc, GateError):
        retry = 1.0 if isinstance(exc, UpstreamUnavailable) else None
        extra = exc.extra if isinstance(exc, ContextExceeded) else None
        return Refusal(
            exc.status, exc.type, exc.code, exc.message, exc.reason, exc.param, retry, None, extra
        )
    if isinstance(exc, AdmissionError):
        return _admission_refusal(exc)
    return Refusal(500, "server_error", "internal_error", "slotgate failed internally", "internal")


def route_refusal(status: int, message: str) -> Refusal:
    """An answer the web framework chose for one of slotgate's own routes (405, 404)."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
    return Refusal(status, "invalid_request_error", code, message, "bad_request")


def _admission_refusal(exc: AdmissionError) -> Refusal:
    snap = exc.snapshot
    counts = f"active={snap.active}, queued={snap.queued}, capacity={snap.capacity}"
    if isinstance(exc, TenantQueueFull) and snap.tenant is not None:
        own = snap.tenant
        message = (
            f"tenant {own.name} has {own.queued} requests waiting already, its limit "
            f"(max_queued; active={own.active}); retry after Retry-After"
        )
        return Refusal(
            429, "rate_limit_error", "tenant_queue_full", message, "tenant_queue_full", None,
            exc.retry_after_s, snap,
        )  # fmt: skip
    if isinstance(exc, QueueFull):
        message = f"llama-server generation queue is full ({counts}); retry after Retry-After"
        return Refusal(
            429, "rate_limit_error", "queue_full", message, "queue_full", None,
            exc.retry_after_s, snap,
        )  # fmt: skip
    if isinstance(exc, QueueTimeout):
        message = f"request waited longer than QUEUE_TIMEOUT for a free slot ({counts})"
        return Refusal(
            503, "unavailable_error", "queue_timeout", message, "queue_timeout", None,
            exc.retry_after_s, snap,
        )  # fmt: skip
    if isinstance(exc, TenantTooLarge):
        message = (
            f"request needs {exc.weight} slots but tenant {exc.tenant} may hold at most "
            f"{exc.limit} at once (max_active={exc.limit}); ask for fewer choices (n) or send "
            "fewer prompts in one request"
        )
        return Refusal(400, "invalid_request_error", "too_many_slots", message, "bad_request", "n")
    if isinstance(exc, TooLarge):
        message = (
            f"request needs {exc.weight} slots but llama-server has {exc.largest}; "
            "ask for fewer choices (n)"
        )
        return Refusal(400, "invalid_request_error", "too_many_slots", message, "bad_request", "n")
    if isinstance(exc, ShuttingDown):
        return Refusal(
            503, "unavailable_error", "shutting_down", "slotgate is shutting down; retry shortly",
            "upstream_unavailable", None, exc.retry_after_s, snap,
        )  # fmt: skip
    assert isinstance(exc, NotReady)  # noqa: S101 - the hierarchy is closed
    return Refusal(
        503, "unavailable_error", "upstream_not_ready",
        "llama-server is not ready (starting, loading the model or unreachable); retry shortly",
        "upstream_unavailable", None, exc.retry_after_s, snap,
    )  # fmt: skip


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
        anthropic_type = {
            "rate_limit_error": "rate_limit_error",
            "unavailable_error": "overloaded_error",
            "server_error": "api_error",
            "not_found_error": "not_found_error",
        }.get(r.type, r.type)
        inner: dict[str, Any] = {"type": anthropic_type, "message": r.message, "code": r.code}
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
        (b"retry-after", str(max(1, math.floor(retry_after_s + 0.5))).encode()),
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
