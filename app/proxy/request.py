"""One request as slotgate takes it in: its id, its checked path, head and body.

`Request` is the one object the relay passes around; what goes back out is `Answer`'s
(app/proxy/answer.py).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING

from slotgate.asgi import Receive, Scope
from slotgate.errors import BadRequest, ClientGone, Flavor, HeadersTooLarge, PayloadTooLarge
from slotgate.gate.tenants import EVERYONE
from slotgate.outcome import Outcome

if TYPE_CHECKING:
    from slotgate.gate.models import Lane
    from slotgate.gate.ticket import Claim
    from slotgate.intake.cost import Estimate
    from slotgate.intake.endpoints import Endpoint
    from slotgate.proxy.assembly import Assembly
    from slotgate.proxy.body_bytes import HeldBody
    from slotgate.upstreams.upstream import Upstream

#: uvicorn sets no bound on header size; llama-server's HTTP library (cpp-httplib) answers a
#: header line over 8 KiB with an empty 400, and only once the request has reached it, slot
#: and all. Anything past these is refused here, before it costs a slot or a connection.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_LINE_BYTES = 8192
_REQUEST_ID_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
_ids = itertools.count(1)
_id_prefix = secrets.token_hex(4)
#: Headers slotgate decides by, which a client cannot make hop-by-hop through Connection: then
#: slotgate would check or key on one value and llama-server see another, or none.
DECIDING = frozenset({b"authorization", b"x-api-key", b"origin"})
#: Read once: an enum member looked up on its class costs a request about 0.1 us.
_SERVED = Outcome.SERVED
#: Shared by every request whose Connection header names nothing.
_NONE_NAMED: frozenset[bytes] = frozenset()


class Request:
    """What slotgate knows of one request, from its head to its access-log line."""

    __slots__ = (
        "assembly", "band", "body", "endpoint", "estimate", "first_byte_at", "gated", "head",
        "headers", "held", "id", "lane", "max_wait_s", "method", "origin", "outcome", "path",
        "query", "started", "stream",
        "teaches", "tenant", "ticket", "upstream", "upstream_status", "weight",
    )  # fmt: skip

    def __init__(self, scope: Scope, held: HeldBody) -> None:
        self.id = request_id(scope)
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: bytes = scope["query_string"]
        self.headers: list[tuple[bytes, bytes]] = scope["headers"]
        self.started = monotonic()
        self.head: Head | None = None
        self.body = b""
        #: The generation route it asks for, gated or not (None: any other path).
        self.endpoint: Endpoint | None = None
        #: It waits for a slot (a generation route, with ADMISSION_CONTROL on).
        self.gated = False
        #: The client asked for an event stream (decided once, at intake).
        self.stream = False
        #: Non-streamed, sent upstream as a stream, and answered from it (app/proxy/assembly.py).
        self.assembly: Assembly | None = None
        #: Sent as it is so that its answer shows whether llama-server adds `__verbose`.
        self.teaches = False
        self.origin: bytes | None = None  # its Origin, for answers slotgate makes itself
        self.ticket: Claim | None = None
        #: Whom it is for: its key's tenant (app/gate/tenants.py); EVERYONE without keys.
        self.tenant = EVERYONE
        #: Its reservation of the KV-cache budget, when a budget binds (app/intake/cost.py).
        self.estimate: Estimate | None = None
        #: How long it may wait for a slot (X-Max-Wait, or its tenant's); None: no bound.
        self.max_wait_s: float | None = None
        #: The band it waits and runs in (read only with PREEMPT_AFTER_S).
        self.band = 0
        self.weight = 0
        #: Its body's bytes, counted against QUEUE_BODY_BYTES until it is admitted.
        self.held = held
        #: The llama-server it goes to: its pool's, once admitted (any, until then).
        self.upstream: Upstream | None = None
        self.upstream_status: int | None = None
        #: When (time.monotonic()) the first byte of llama-server's answer body arrived.
        self.first_byte_at: float | None = None
        self.outcome: Outcome = _SERVED
        #: Its model's line, when routers serve several models (app/gate/models.py).
        self.lane: Lane | None = None

    @property
    def route(self) -> str | None:
        return self.endpoint.route if self.endpoint is not None else None

    @property
    def flavor(self) -> Flavor:
        """The error shape its client reads."""
        return self.endpoint.flavor if self.endpoint is not None else "openai"


#: The names `Head` reads.
_LOOKED_AT = frozenset(
    {
        b"content-length", b"content-type", b"authorization", b"x-api-key", b"x-priority",
        b"x-max-wait", b"origin", b"connection",
    }
)  # fmt: skip


class Head:
    """The request headers slotgate looks at, found in one pass."""

    __slots__ = (
        "api_key", "authorization", "connection_named", "content_length", "content_type",
        "max_wait", "origin", "priority", "raw",
    )  # fmt: skip

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self.authorization: bytes | None = None
        self.api_key: bytes | None = None
        self.content_length: int | None = None
        self.content_type = ""
        self.origin: bytes | None = None
        self.priority: bytes | None = None  # X-Priority: a lower band asked for
        self.max_wait: bytes | None = None  # X-Max-Wait: its bound on waiting, in seconds
        self.connection_named = _NONE_NAMED
        size = 0
        for name, value in raw:
            line = len(name) + len(value) + 4  # name: value CRLF, as llama-server counts it
            if line > MAX_HEADER_LINE_BYTES:
                raise HeadersTooLarge(
                    f"request header {name[:64].decode('latin-1')} is longer than "
                    f"{MAX_HEADER_LINE_BYTES} bytes, which llama-server refuses"
                )
            size += line
            if name not in _LOOKED_AT:
                continue  # most of a client's headers: one set lookup, not eight comparisons
            if name == b"content-length":
                if not value.isdigit():
                    raise BadRequest("Content-Length is not a number")
                self.content_length = int(value)
            elif name == b"content-type":
                self.content_type = value.decode("latin-1")
            elif name == b"authorization":
                self.authorization = value
            elif name == b"x-api-key":
                self.api_key = value
            elif name == b"x-priority":
                self.priority = value
            elif name == b"x-max-wait":
                # Which of several a client meant is anyone's guess: none is picked.
                if self.max_wait is not None:
                    raise BadRequest("more than one X-Max-Wait header", param="X-Max-Wait")
                self.max_wait = value
            elif name == b"origin":
                # llama-server reads the first; one value only, so both sides read the same.
                if self.origin is not None:
                    raise BadRequest("more than one Origin header")
                self.origin = value
            elif name == b"connection":
                # Headers named in Connection are hop-by-hop too, but never ones slotgate
                # itself decides by: a client cannot make the gate drop what it checked.
                named = {part.strip().lower() for part in value.split(b",")}
                self.connection_named = frozenset(named - DECIDING)
        if size > MAX_HEADER_BYTES:
            raise HeadersTooLarge(f"request headers exceed {MAX_HEADER_BYTES} bytes")


def checked_path(path: str) -> str:
    """The decoded path, refused when it could step outside llama-server's root."""
    if not path.startswith("/") or "\\" in path or "\x00" in path:
        raise BadRequest("request path is not a plain absolute path")
    if "/./" in path + "/" or "/../" in path + "/":
        raise BadRequest("request path must not contain '.' or '..' segments")
    return path


async def read_body(
    receive: Receive, declared: int | None, limit: int, count: Callable[[int], None] | None = None
) -> bytes:
    """The whole body; `count` is told its bytes before they are held: the declared length
    before a byte is read, or (chunked) each piece's as it arrives. It may refuse (raise)."""
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"request body is {declared} bytes; the limit is {limit} (MAX_BODY_BYTES)"
        )
    unsized = count
    if count is not None and declared is not None:
        count(declared)
        unsized = None
    message = await receive()
    # A client that closed before its body was whole (or sent broken chunked framing, which
    # uvicorn answers 400 and closes): nothing it sent may go upstream, not even the head.
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    # A chunked body declares no length, and may arrive whole in one message.
    if len(body) > limit:
        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes (MAX_BODY_BYTES)")
    if unsized is not None:
        unsized(len(body))
    if not message.get("more_body", False):
        return _whole(body, declared)
    chunks = [body]
    size = len(body)
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(
                f"request body is over the limit of {limit} bytes (MAX_BODY_BYTES)"
            )
        if unsized is not None:
            unsized(len(chunk))
        chunks.append(chunk)
    return _whole(b"".join(chunks), declared)


def _whole(body: bytes, declared: int | None) -> bytes:
    if declared is not None and len(body) != declared:
        raise BadRequest(f"request body is {len(body)} bytes, not the {declared} declared")
    return body


async def preflight_body(receive: Receive, declared: int | None) -> bytes:
    try:
        return await read_body(receive, declared, 0)
    except PayloadTooLarge:
        raise BadRequest(
            "an OPTIONS request without a key is a preflight, and has no body"
        ) from None


def request_id(scope: Scope) -> str:
    """The client's X-Request-Id when it is a sane one, else slotgate's own."""
    # Typed: compiled, a list of pairs is walked and unpacked in place, not through iterators.
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= 128 and all(c in _REQUEST_ID_CHARS for c in value):
                return bytes(value).decode()
            break
    return f"{_id_prefix}-{next(_ids)}"
