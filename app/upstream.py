"""The only code that talks to llama-server: its connection pool and the capacity follower."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .admission import Admission
from .client import Client, ClientError, ConnectFailed, Disconnected, Header, Response, Stalled
from .cors import CorsPolicy
from .errors import UpstreamFailed, UpstreamUnavailable
from .settings import Settings

log = logging.getLogger("slotgate.upstream")

#: How long a connection attempt or a /props read may take before llama-server counts as down.
CONNECT_TIMEOUT_S = 5.0
#: llama-server (cpp-httplib) closes idle keep-alive connections after 5 s; reusing one just as
#: it closes would fail a POST that cannot safely be retried, so idle ones are dropped sooner.
KEEPALIVE_S = 4.0
#: While llama-server is down or loading, look again this often rather than every refresh.
NOT_READY_RETRY_S = 1.0
#: The most of /props or /metrics slotgate reads; llama-server's are tens of KiB at most (the
#: chat template is the largest part), and an answer past this is no /props slotgate can use.
CONTROL_BODY_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Props:
    """What slotgate keeps from llama-server's /props."""

    total_slots: int
    n_ctx: int | None
    model: str | None
    build_info: str | None

    @classmethod
    def parse(cls, body: Any) -> Props:
        if not isinstance(body, dict):
            raise ValueError("/props did not answer a JSON object")  # noqa: TRY004 - bad data, not a bad call
        slots = body.get("total_slots")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"/props total_slots is {slots!r}, not a positive integer")
        settings = body.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        model = body.get("model_alias") or body.get("model_path")
        build = body.get("build_info")
        return cls(
            slots,
            n_ctx if isinstance(n_ctx, int) else None,
            model if isinstance(model, str) else None,
            build if isinstance(build, str) else None,
        )


class Upstream:
    """llama-server behind one connection pool, and what slotgate knows of its state."""

    def __init__(self, settings: Settings, admission: Admission) -> None:
        self.url = settings.llama_server_url
        parts = urlsplit(self.url)
        self._root = parts.path
        self._admission = admission
        self._refresh_s = settings.props_refresh_interval
        tls = parts.scheme == "https"
        # The pool has no connection limit: the admission pool bounds concurrent generations,
        # and a limit here would only become a second, hidden queue behind the gate.
        self._client = Client(
            parts.hostname or "127.0.0.1",
            parts.port or (443 if tls else 80),
            tls=tls,
            connect_timeout_s=CONNECT_TIMEOUT_S,
            keepalive_s=KEEPALIVE_S,
            stall_s=settings.upstream_stall_timeout or None,
        )
        key = settings.llama_api_key
        self.auth: Header | None = (
            (b"authorization", f"Bearer {key.get_secret_value()}".encode()) if key else None
        )
        self.props: Props | None = None
        #: Its CORS policy, as its answers show it, for the answers slotgate makes itself.
        self.cors = CorsPolicy()
        self.ready = False
        self.reason = "llama-server not contacted yet"
        self._follower: asyncio.Task[None] | None = None
        self._poke = asyncio.Event()

    @property
    def keeps_streams(self) -> bool | None:
        """Does llama-server keep a connection open after an event stream? None until seen."""
        return self._client.streams_kept

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._follower = asyncio.create_task(self._follow(), name="slotgate-props-follower")

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        self._client.close()

    # -- requests ------------------------------------------------------------------------------

    async def send(self, method: str, target: str, headers: list[Header], body: bytes) -> Response:
        """Send one request (target: a checked, quoted path and query) and return the response
        with its head read and its body still to come."""
        try:
            return await self._client.request(method, self._root + target, headers, body)
        except (ConnectFailed, Disconnected) as exc:
            self.poke()
            raise UpstreamUnavailable(
                f"llama-server at {self.url} cannot be reached ({exc}); retry shortly"
            ) from None
        except Stalled:
            raise UpstreamFailed(
                "llama-server did not answer within UPSTREAM_STALL_TIMEOUT"
            ) from None
        except ClientError as exc:
            raise UpstreamFailed(f"llama-server answered badly ({exc})") from None

    async def _get(self, path: str) -> tuple[int, bytes]:
        headers = [self.auth] if self.auth else []
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            response = await self._client.request("GET", self._root + path, headers, b"")
            try:
                body = await response.read(CONTROL_BODY_BYTES)
            except BaseException:
                response.close()
                raise
            response.release()
            return response.status, body

    async def metrics(self) -> bytes:
        """llama-server's own /metrics (it needs --metrics), or nothing when it has none."""
        if not self.ready:
            return b""
        try:
            status, body = await self._get("/metrics")
        except (ClientError, TimeoutError):
            return b""
        return body if status == 200 else b""

    def poke(self) -> None:
        """Something went wrong with llama-server: read /props again now, not at the next tick."""
        self._poke.set()

    # -- capacity ------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read /props once and follow its slot count; mark not ready on any failure."""
        try:
            status, body = await self._get("/props")
            if status != 200:
                text = body[:200].decode("utf-8", "replace")
                if status == 401 and self.auth is None:
                    # slotgate needs /props for the slot count, and llama-server started with
                    # --api-key guards it: only the operator can give slotgate that key.
                    text = "llama-server wants an API key: set LLAMA_API_KEY to it"
                raise ValueError(f"/props answered {status}: {text}")  # noqa: TRY301 - one handler for every way /props fails
            props = Props.parse(json.loads(body))
        except (ClientError, TimeoutError, ValueError) as exc:
            self._mark_not_ready(f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc))
            return
        if self.props is not None and props.build_info != self.props.build_info:
            self._client.relearn()
            self.cors.forget()
        if self.props is None or props.total_slots != self.props.total_slots or not self.ready:
            log.info(
                "llama-server ready: total_slots=%d n_ctx=%s model=%s",
                props.total_slots, props.n_ctx, props.model,
            )  # fmt: skip
        self.props = props
        self.ready = True
        self.reason = "ready"
        self._admission.resize(props.total_slots)

    def _mark_not_ready(self, reason: str) -> None:
        if self.ready or reason != self.reason:
            log.warning("llama-server not ready: %s", reason)
        self._client.relearn()  # what comes back may be another build
        self.cors.forget()
        self.ready = False
        self.reason = reason
        self._admission.resize(None)

    async def _follow(self) -> None:
        while True:
            self._poke.clear()
            await self.refresh()
            interval = self._refresh_s if self.ready else min(self._refresh_s, NOT_READY_RETRY_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._poke.wait()
