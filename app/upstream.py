"""The only code that talks to llama-server: one pooled HTTP client and the capacity follower."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from app.admission import Admission
from app.errors import UpstreamFailed, UpstreamUnavailable
from app.settings import Settings

log = logging.getLogger("slotgate.upstream")

#: How long a connection attempt or a /props read may take before llama-server counts as down.
CONNECT_TIMEOUT_S = 5.0
#: llama-server (cpp-httplib) closes idle keep-alive connections after 5 s; reusing one just as
#: it closes would fail a POST that cannot safely be retried, so idle ones are dropped sooner.
KEEPALIVE_S = 4.0
#: While llama-server is down or loading, look again this often rather than every refresh.
NOT_READY_RETRY_S = 1.0


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


async def _read_props(response: aiohttp.ClientResponse) -> Props:
    if response.status != 200:
        text = (await response.read())[:200].decode("utf-8", "replace")
        raise ValueError(f"/props answered {response.status}: {text}")
    return Props.parse(await response.json(content_type=None))


class Upstream:
    """llama-server behind one aiohttp session, and what slotgate knows of its state."""

    def __init__(self, settings: Settings, admission: Admission) -> None:
        self.url = settings.llama_server_url
        self._root = urlsplit(self.url).path
        self._admission = admission
        self._refresh_s = settings.props_refresh_interval
        self._stall_s = settings.upstream_stall_timeout or None
        key = settings.llama_api_key
        self.auth: tuple[str, str] | None = (
            ("Authorization", f"Bearer {key.get_secret_value()}") if key else None
        )
        self.props: Props | None = None
        self.ready = False
        self.reason = "llama-server not contacted yet"
        self._session: aiohttp.ClientSession | None = None
        self._follower: asyncio.Task[None] | None = None
        self._poke = asyncio.Event()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # limit=0: the admission pool bounds concurrent generations, and a connection limit
        # here would only turn into a second, hidden queue behind the gate.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=CONNECT_TIMEOUT_S,
            sock_connect=CONNECT_TIMEOUT_S,
            sock_read=self._stall_s,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )
        self._follower = asyncio.create_task(self._follow(), name="slotgate-props-follower")

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        if self._session is not None:
            await self._session.close()

    # -- requests ------------------------------------------------------------------------------

    def target(self, path: str, query: bytes) -> URL:
        """The upstream URL for a request path that has already been checked to stay in root."""
        url = self.url + path
        if query:
            url += "?" + query.decode("latin-1")
        return URL(url, encoded=True)

    async def send(
        self, method: str, url: URL, headers: list[tuple[str, str]], body: bytes
    ) -> aiohttp.ClientResponse:
        """Send one request and return the response with its body still unread."""
        assert self._session is not None  # noqa: S101 - start() ran in the lifespan
        try:
            return await self._session.request(
                method, url, headers=headers, data=body or None, allow_redirects=False
            )
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            self.poke()
            raise UpstreamUnavailable(
                f"llama-server at {self.url} cannot be reached ({type(exc).__name__}); "
                "retry shortly"
            ) from None
        except TimeoutError:
            raise UpstreamFailed(
                "llama-server did not answer within UPSTREAM_STALL_TIMEOUT"
            ) from None
        except aiohttp.ClientError as exc:
            raise UpstreamFailed(
                f"llama-server answered something that is not HTTP ({type(exc).__name__})"
            ) from None

    async def metrics(self) -> bytes:
        """llama-server's own /metrics (it needs --metrics), or nothing when it has none."""
        if self._session is None or not self.ready:
            return b""
        headers = [self.auth] if self.auth else []
        try:
            async with (
                asyncio.timeout(CONNECT_TIMEOUT_S),
                self._session.get(self.url + "/metrics", headers=headers) as response,
            ):
                return await response.read() if response.status == 200 else b""
        except (aiohttp.ClientError, TimeoutError):
            return b""

    def poke(self) -> None:
        """Something went wrong with llama-server: read /props again now, not at the next tick."""
        self._poke.set()

    # -- capacity ------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read /props once and follow its slot count; mark not ready on any failure."""
        assert self._session is not None  # noqa: S101 - start() ran in the lifespan
        headers = [self.auth] if self.auth else []
        try:
            async with (
                asyncio.timeout(CONNECT_TIMEOUT_S),
                self._session.get(self.url + "/props", headers=headers) as response,
            ):
                props = await _read_props(response)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._mark_not_ready(f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc))
            return
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
