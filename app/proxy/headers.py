"""Which headers cross the gate: what goes on to llama-server, what comes back, and what slotgate
adds (the request id, an event stream's head, the CORS exposure of both).

Each function runs once per request; they build lists in one pass, as the relay did inline.
"""

from __future__ import annotations

from collections.abc import Iterable

from slotgate.asgi import Header, Headers
from slotgate.upstreams.cors import CorsPolicy

# RFC 9110 section 7.6.1 connection-specific fields, plus the ones a proxy sets itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
        b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
        b"host", b"content-length", b"expect",
    }
)  # fmt: skip
_CREDENTIALS = frozenset({b"authorization", b"x-api-key"})
_RESPONSE_DROP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
     b"proxy-connection", b"date", b"server"}
)  # fmt: skip
#: An assembled answer is a JSON body of its own: the stream's framing headers do not apply.
_ASSEMBLED_DROP = _RESPONSE_DROP | {
    b"content-type", b"content-length", b"x-accel-buffering", b"cache-control"
}  # fmt: skip
SSE = "text/event-stream"
#: The head of an event stream slotgate starts itself.
SSE_HEAD: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def dropped(*, keep_conversation_id: bool, keep_credentials: bool) -> frozenset[bytes]:
    """The client's headers that never reach llama-server: the hop-by-hop ones and the request
    id (llama-server logs slotgate's: the client's own when it is valid); the conversation id
    unless FORWARD_CONVERSATION_ID; the client's credentials when slotgate checks or supplies
    its own."""
    drop = {*_HOP_BY_HOP, b"x-request-id"}
    if not keep_conversation_id:
        drop.add(b"x-conversation-id")
    if not keep_credentials:
        drop |= _CREDENTIALS
    return frozenset(drop)


def upstream_headers(
    raw: Iterable[Header],
    drop: frozenset[bytes],
    named: frozenset[bytes],
    auth: Header | None,
    request_id: str,
) -> Headers:
    """The request's headers as llama-server gets them: without `drop` and what the client's
    Connection header `named`, with slotgate's key (`auth`) and the request id."""
    headers = [(n, v) for n, v in raw if n not in drop and n not in named]
    if auth is not None:
        headers.append(auth)
    headers.append((b"x-request-id", request_id.encode()))
    return headers


def relayed(
    upstream: Iterable[Header], request_id: str, origin: bytes | None, *, stream: bool
) -> Headers:
    """llama-server's headers as the client gets them with its answer relayed as it is: an
    event stream's head completed to slotgate's own. (Names come lowercased, as the upstream
    client parses them.)"""
    headers = [(name, value) for name, value in upstream if name not in _RESPONSE_DROP]
    headers += id_headers(request_id)
    if origin is not None:
        CorsPolicy.expose(headers)
    if stream:
        present = {name for name, _ in headers}
        headers.extend(h for h in SSE_HEAD[1:] if h[0] not in present)
    return headers


def assembled(
    upstream: Iterable[Header], request_id: str, origin: bytes | None, length: int
) -> Headers:
    """llama-server's own headers (CORS among them), but those of a JSON body of `length`."""
    headers = [(name, value) for name, value in upstream if name not in _ASSEMBLED_DROP]
    headers += [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"content-length", str(length).encode()),
        *id_headers(request_id),
    ]
    if origin is not None:
        CorsPolicy.expose(headers)
    return headers


def own_headers(request_id: str, cors: CorsPolicy, origin: bytes | None) -> Headers:
    """What an answer slotgate makes itself carries: the request id, and the CORS header
    llama-server would give the request's Origin (app/upstreams/cors.py)."""
    return [*id_headers(request_id), *cors.headers_for(origin)]


def id_headers(request_id: str) -> Headers:
    """The request id under both names clients read: `x-request-id` (OpenAI's SDKs) and
    `request-id` (Anthropic's, for the `request_id` of its responses and errors)."""
    value = request_id.encode()
    return [(b"x-request-id", value), (b"request-id", value)]
