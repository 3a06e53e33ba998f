"""One llama-server as slotgate talks to it: its URL and key, the one client, `send` (the
relay holds the response it returns in a scope of its own), its control paths, and whether
anything has answered there yet. What it reports (readiness, slots, a router's models) is
followed by `Upstream` (upstream.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit

import orjson
from slotgate.asgi import Header
from slotgate.errors import (
    ConnectFailed,
    Disconnected,
    ExchangeFailed,
    Stalled,
    UpstreamFailed,
    UpstreamStarting,
)
from slotgate.settings import Settings
from slotgate.upstreams.client import Response
from slotgate.upstreams.reuse import UpstreamClient

#: How long a connection attempt or a /props read may take before llama-server counts as down.
CONNECT_TIMEOUT_S = 5.0
#: llama-server (cpp-httplib) closes idle keep-alive connections after 5 s; reusing one just as
#: it closes would fail a POST that cannot safely be retried, so idle ones are dropped sooner.
KEEPALIVE_S = 4.0

#: The most bytes a count's answer takes per byte of its question, beyond CONTROL_BODY_BYTES:
#: a token id and its comma take at most 8 bytes, and a token is at least one byte of prompt.
_COUNT_BYTES_PER_BYTE = 8

#: The most of /props or /metrics slotgate reads; llama-server's are tens of KiB at most (the
#: chat template is the largest part), and an answer past this is no /props slotgate can use.
CONTROL_BODY_BYTES = 1024 * 1024


class Requester(Protocol):
    """What `LlamaServer` asks of its HTTP client: `UpstreamClient`, or a stand-in a test puts
    in its place (a compiled class takes no attribute of another class than it names)."""

    @property
    def keeps_streams(self) -> bool | None: ...

    async def request(
        self, method: str, target: str, headers: Iterable[Header], body: bytes
    ) -> Response: ...

    def connect_to(self, address: str | None) -> None: ...

    def relearn(self) -> None: ...

    def close(self) -> None: ...


def address_url(parts: SplitResult, address: str) -> str:
    """`parts` as a URL with `address` for its host."""
    host = f"[{address}]" if ":" in address else address
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return parts._replace(netloc=netloc).geturl()


class LlamaServer:
    """llama-server behind one client: how slotgate reaches it, not what it knows of its state."""

    def __init__(self, settings: Settings, url: str | None = None, address: str | None = None):
        parts = urlsplit(url or settings.llama_server_url)
        #: Its base URL; for one of the addresses a name resolves to, with that address in it.
        self.url = parts.geturl() if address is None else address_url(parts, address)
        #: The URL as configured (the name, when it resolves to several addresses).
        self.configured = parts.geturl()
        self._root = parts.path
        tls = parts.scheme == "https"
        # The client has no connection limit: the admission pool bounds concurrent generations,
        # and a limit here would only become a second, hidden queue behind the gate.
        self._client: Requester = UpstreamClient(
            parts.hostname or "127.0.0.1",
            parts.port or (443 if tls else 80),
            tls=tls,
            connect_timeout_s=CONNECT_TIMEOUT_S,
            keepalive_s=KEEPALIVE_S,
            stall_s=settings.upstream_stall_timeout_s or None,
            address=address,
        )
        key = settings.llama_api_key
        self.auth: Header | None = (
            (b"authorization", f"Bearer {key.get_secret_value()}".encode()) if key else None
        )
        #: Why it cannot be reached, while nothing has ever answered there since slotgate
        #: started: an address nobody listens on (a wrong LLAMA_SERVER_URL) is not a
        #: llama-server that is loading, so requests are refused at once instead of waiting
        #: STARTUP_WAIT_S for it. None once anything answered there, or before the first try.
        self.unreached: str | None = None
        self._answered = False
        #: Response heads it has sent to requests: a /props read that times out while this
        #: moves found it busy (or slotgate's own loop late), not gone.
        self.answers = 0
        #: Set when a request finds it gone, or it seems back: whoever follows its state
        #: (`Upstream`) looks again at once instead of at its next tick.
        self._poke = asyncio.Event()

    def readdress(self, address: str | None) -> None:
        """Known by its name so far, it is now one of the name's several addresses: this one;
        or, None, the other way round: its name resolves to it alone again."""
        self.url = (
            self.configured if address is None else address_url(urlsplit(self.configured), address)
        )
        self._client.connect_to(address)

    @property
    def name(self) -> str:
        """How operators name it (`/admission`, `/admin/upstreams/{name}/...`): its URL's host,
        port and path, without the scheme."""
        parts = urlsplit(self.url)
        return parts.netloc + parts.path.rstrip("/")

    @property
    def keeps_streams(self) -> bool | None:
        """Does llama-server keep a connection open after an event stream? None until seen."""
        return self._client.keeps_streams

    def poke(self) -> None:
        """Something went wrong with llama-server, or it seems back: read /props again now,
        not at the next tick."""
        self._poke.set()

    # -- requests ------------------------------------------------------------------------------

    async def send(self, method: str, target: str, headers: list[Header], body: bytes) -> Response:
        """Send one request (target: a checked, quoted path and query) and return the response
        with its head read and its body still to come."""
        try:
            response = await self._client.request(method, self._root + target, headers, body)
        except ConnectFailed as exc:
            self._not_reached(exc)
            self.poke()
            raise UpstreamStarting(
                f"llama-server at {self.url} cannot be reached ({exc}); retry shortly"
            ) from None
        except Disconnected as exc:
            self.poke()
            raise UpstreamStarting(
                f"llama-server at {self.url} cannot be reached ({exc}); retry shortly", sent=True
            ) from None
        except Stalled:
            raise UpstreamFailed(
                "llama-server did not answer within UPSTREAM_STALL_TIMEOUT_S"
            ) from None
        except ExchangeFailed as exc:
            raise UpstreamFailed(f"llama-server answered badly ({exc})") from None
        self.answers += 1
        if not self._answered:
            self._reached()
        return response

    def _not_reached(self, exc: ConnectFailed) -> None:
        if not self._answered:
            self.unreached = (
                f"llama-server at {self.url} has not been reachable since slotgate started "
                f"({exc}); check LLAMA_SERVER_URL, or retry once it is up"
            )

    def _reached(self) -> None:
        self._answered = True
        self.unreached = None

    # -- control paths -------------------------------------------------------------------------

    async def get(self, path: str) -> tuple[int, bytes]:
        """GET one of llama-server's control paths (its own key sent), within
        CONNECT_TIMEOUT_S; its status and body, read up to CONTROL_BODY_BYTES."""
        return await self._get(path)

    async def post(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """POST JSON to one of llama-server's control paths, within CONNECT_TIMEOUT_S."""
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            return await self._post(path, payload)

    async def _get(self, path: str) -> tuple[int, bytes]:
        status, body, _ = await self._get_with_headers(path)
        return status, body

    async def _get_with_headers(self, path: str) -> tuple[int, bytes, list[Header]]:
        headers = [self.auth] if self.auth else []
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            response = await self._client.request("GET", self._root + path, headers, b"")
            try:
                body = await response.read(CONTROL_BODY_BYTES)
            except BaseException:
                response.close()
                raise
            response.release()
            return response.status, body, response.headers

    async def _post(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """POST a count request; an answer longer than its question can justify is not read
        (a templated prompt, or a token list, takes a few bytes per byte asked about)."""
        headers: list[Header] = [(b"content-type", b"application/json")]
        if self.auth:
            headers.append(self.auth)
        body = orjson.dumps(payload)
        response = await self._client.request("POST", self._root + path, headers, body)
        try:
            answer = await response.read(CONTROL_BODY_BYTES + _COUNT_BYTES_PER_BYTE * len(body))
        except BaseException:
            response.close()
            raise
        response.release()
        return response.status, answer


__all__ = ["CONNECT_TIMEOUT_S", "CONTROL_BODY_BYTES", "LlamaServer", "Requester", "address_url"]
