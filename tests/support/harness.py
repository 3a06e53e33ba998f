"""An in-memory harness for the request path: a fake ASGI receive/send, a fake upstream
response, and a `Proxy` wired to them; no sockets. Streaming and disconnects over real
sockets stay with the uvicorn-based tests (tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from slotgate.asgi import Header, Message, Scope
from slotgate.errors import ExchangeFailed
from slotgate.gate.admission import Admission
from slotgate.metrics import Metrics
from slotgate.proxy.relay import Proxy
from slotgate.settings import Settings
from slotgate.upstreams.client import Response
from slotgate.upstreams.fleet import Fleet
from slotgate.upstreams.server import Requester


class Client:
    """The ASGI side: what the client sent, and every message slotgate sent back."""

    def __init__(self, body: bytes = b"") -> None:
        self.sent: list[Message] = []
        self._body = body
        self._read = False
        self.gone = asyncio.Event()

    async def receive(self) -> Message:
        if not self._read:
            self._read = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        # After the body, block until the client leaves (an ASGI server's receive does too).
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        starts = [m["status"] for m in self.sent if m["type"] == "http.response.start"]
        assert len(starts) <= 1, starts
        return starts[0] if starts else None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def ended(self) -> bool:
        return any(
            m["type"] == "http.response.body" and not m.get("more_body", False) for m in self.sent
        )


class FakeResponse:
    """An upstream response: a head, then `chunks` one by one, then `failure` if given."""

    def __init__(
        self,
        status: int,
        headers: list[Header],
        chunks: Iterable[bytes],
        failure: ExchangeFailed | None = None,
        hold: asyncio.Event | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self._chunks = list(chunks)
        self._failure = failure
        self._hold = hold  # the body waits for it: a generation that runs until told
        self.released = False
        self.closed = False
        self.failed = False
        self.content_type = (self.header(b"content-type") or b"").split(b";")[0].decode()
        length = self.header(b"content-length")
        self.content_length = int(length) if length is not None else None

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        if self._hold is not None:
            await self._hold.wait()
        if self._chunks:
            return self._chunks.pop(0)
        if self._failure is not None:
            self.failed = True
            raise self._failure
        return b""

    async def read(self, limit_bytes: int | None = None) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def when_done(self, callback: Callable[[], object]) -> None:
        """Not called back: the relay's own call at the end of its reading hands the slot on
        (the real connection's early call is tested on real sockets)."""

    def release(self) -> None:
        """As `client.Response.release`: a response that failed closes its connection."""
        if self.failed:
            self.close()
        elif not self.closed:
            self.released = True

    def close(self) -> None:
        if not self.released:
            self.closed = True


class FakeUpstreamClient:
    """Stands in for the HTTP client inside `Upstream`: answers every request with the next
    response given (or raises it, when it is an exception)."""

    def __init__(self, *answers: FakeResponse | ExchangeFailed) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, str, bytes]] = []
        self.keeps_streams: bool | None = None

    async def request(
        self, method: str, target: str, headers: Iterable[Header], body: bytes
    ) -> FakeResponse:
        self.requests.append((method, target, body))
        answer = self.answers.pop(0)
        if isinstance(answer, ExchangeFailed):
            raise answer
        return answer

    def connect_to(self, address: str | None) -> None:
        pass

    def relearn(self) -> None:
        pass

    def close(self) -> None:
        pass


class PassingClient:
    """An upstream's client that passes everything on to `client`; a test's subclass overrides
    `request` to watch or hold what goes through."""

    def __init__(self, client: Requester) -> None:
        self.client = client

    @property
    def keeps_streams(self) -> bool | None:
        return self.client.keeps_streams

    async def request(
        self, method: str, target: str, headers: Iterable[Header], body: bytes
    ) -> Response:
        return await self.client.request(method, target, headers, body)

    def connect_to(self, address: str | None) -> None:
        self.client.connect_to(address)

    def relearn(self) -> None:
        self.client.relearn()

    def close(self) -> None:
        self.client.close()


class Rig:
    """A `Proxy` over a ready fake llama-server with `slots` slots."""

    def __init__(self, client: FakeUpstreamClient, slots: int = 1, **settings: Any) -> None:
        values: dict[str, Any] = {"llama_server_url": "http://127.0.0.1:9", "startup_wait_s": 0}
        values.update(settings)
        self.settings = Settings(_env_file=None, **values)
        self.admission = Admission(self.settings.queue_policy)
        self.fleet = Fleet(self.settings, self.admission)
        self.upstream = self.fleet.upstreams[0]
        self.upstream._client = client
        self.upstream.ready = True
        self.admission.resize(slots)
        self.metrics = Metrics(self.admission, lambda: True)
        self.proxy = Proxy(self.settings, self.admission, self.fleet, self.metrics)

    async def call(self, client: Client, path: str = "/v1/chat/completions") -> None:
        await self.proxy(http_scope("POST", path), client.receive, client.send)


def http_scope(method: str, path: str, headers: list[Header] | None = None) -> Scope:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "headers": headers or [(b"content-type", b"application/json")],
    }


def chat_body(*, stream: bool) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": stream})


SSE: list[Header] = [(b"content-type", b"text/event-stream")]
