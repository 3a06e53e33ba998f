"""What slotgate knows of one llama-server's state, followed from its `/props`: ready or not
and why, its slots and KV budget for its pools, its speed, its counts of a prompt's tokens, and
a router's models once it shows itself one (router.py). How slotgate reaches it is `LlamaServer`
(server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import orjson
from slotgate.asgi import Header
from slotgate.errors import ConnectFailed, ExchangeFailed
from slotgate.gate.pool import Pool
from slotgate.gate.ticket import Claim
from slotgate.intake.cost import Estimate, counted
from slotgate.intake.pace import generation_speed
from slotgate.settings import Settings
from slotgate.upstreams.cors import CorsPolicy
from slotgate.upstreams.props import Props
from slotgate.upstreams.router import Router
from slotgate.upstreams.server import CONNECT_TIMEOUT_S, LlamaServer

log = logging.getLogger("slotgate.upstream")

#: While llama-server is down or loading, look again this often rather than every refresh.
NOT_READY_RETRY_S = 1.0
#: ... and this often while requests wait for it: nothing can be generating then, so reading
#: /props costs llama-server nothing, and a waiter is let in this soon after it is back.
STARTING_POLL_S = 0.15
#: llama-server's message when the requests in flight need more KV cache than it has.
_CONTEXT_EXHAUSTED = b"Context size has been exceeded"

#: llama-server's own headers on /metrics that slotgate's merged /metrics carries on.
_METRICS_HEADERS = frozenset({b"process-start-time-unix"})


class Upstream(LlamaServer):
    """A llama-server and what slotgate knows of its state: its follower reads `/props`."""

    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        url: str | None = None,
        address: str | None = None,
        on_ready: Callable[[], None] | None = None,
        routing: Callable[[Upstream], Router] | None = None,
    ) -> None:
        super().__init__(settings, url, address)
        self.pool = pool
        #: The bound on a prompt's count, both its round trips.
        self.count_timeout_s = CONNECT_TIMEOUT_S
        self._refresh_s = settings.props_refresh_interval_s
        self._kv_budget_tokens = settings.kv_budget_tokens
        # Known before llama-server is: requests that wait for it to start are weighed by it.
        pool.resize_budget(settings.kv_budget_tokens)
        #: Seen llama-server run out of a cache its slots share (KV_BUDGET_TOKENS unset).
        self.shared_cache_seen = False
        self.props: Props | None = None
        #: Called each time it becomes ready (the fleet compares the upstreams' models).
        self._on_ready = on_ready
        #: One generation's tokens per second, as llama-server's /metrics last told it.
        self.tokens_per_s: float | None = None
        #: Its CORS policy, as its answers show it, for the answers slotgate makes itself.
        self.cors = CorsPolicy()
        self.ready = False
        self.reason = "llama-server not contacted yet"
        #: It adds `__verbose` to its answers unasked (--verbose), which assembly cannot
        #: rebuild; None until an answer has shown it (app/proxy/modes.py, `_learn_verbose`).
        self.verbose: bool | None = None
        self._follower: asyncio.Task[None] | None = None
        #: Makes its `Router` once its /props says it is one (the fleet's models); None: a
        #: router is followed as nothing more than a server that is not ready.
        self._routing = routing
        #: The models it serves, when it is a llama-server in router mode; else None.
        self.router: Router | None = None
        #: Its pool in its model's line, once upstreams of different models are routed by
        #: model (app/upstreams/fleet.py); sized with `pool`.
        self.model_pool: Pool | None = None
        #: The model (its /props model) it served when placed in that line.
        self.placed_model: str | None = None

    def readdress(self, address: str | None) -> None:
        """Known by its name so far, it is now one of the name's several addresses: this one;
        or, None, the other way round: its name resolves to it alone again. Its pool is
        renamed with it."""
        super().readdress(address)
        self.pool.rename(self.url)

    @property
    def draining(self) -> bool:
        """An operator drained it (`drain`), until `restore`."""
        return self.pool.draining

    def drain(self) -> None:
        """Out of rotation (an operator's): its pool, its pool in its model's line, and a
        router's pool in each of its models' lines; what runs there finishes."""
        self.pool.drain()
        if self.model_pool is not None:
            self.model_pool.drain()
        if self.router is not None:
            self.router.drain()

    def restore(self) -> None:
        """Back in rotation, every pool of it with its last reported slots."""
        self.pool.restore()
        if self.model_pool is not None:
            self.model_pool.restore()
        if self.router is not None:
            self.router.restore()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._follower = asyncio.create_task(self._follow(), name="slotgate-props-follower")

    async def close(self) -> None:
        if self.router is not None:
            self.router.close()
        if self._follower is not None:
            self._follower.cancel()
            # Not `await` under suppress(CancelledError): that would swallow a cancellation
            # of the caller's own task too.
            await asyncio.wait((self._follower,))
            if not self._follower.cancelled() and (error := self._follower.exception()) is not None:
                raise error
        self._client.close()

    async def metrics(self, path: str = "/metrics") -> tuple[bytes, list[Header]]:
        """llama-server's own /metrics (it needs --metrics) and the headers of its own that
        the merged answer keeps (Process-Start-Time-Unix); nothing when it has none. `path`
        names a router's child (`/metrics?model=ID`)."""
        if not self.ready:
            return b"", []
        try:
            status, body, headers = await self._get_with_headers(path)
        except (ExchangeFailed, TimeoutError):
            return b"", []
        if status != 200:
            return b"", []
        return body, [(name, value) for name, value in headers if name in _METRICS_HEADERS]

    def lost(self, reason: str) -> None:
        """llama-server is away (a request found it so): not ready until /props says again."""
        if self.ready:
            self._mark_not_ready(reason)
        self.poke()

    def stopped(self, reason: str) -> None:
        """Its process ended (a local engine slotgate started): its slots are gone at once;
        the follower goes on looking, in case something comes back at its address."""
        if self.ready:
            self._mark_not_ready(reason)

    # -- capacity ------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read /props once and follow its slot count; mark not ready on any failure, but for
        a read that times out while llama-server goes on answering requests."""
        answers = self.answers
        try:
            status, body = await self._get("/props")
            if not self._answered:
                self._reached()
            if status != 200:
                text = body[:200].decode("utf-8", "replace")
                if status == 401 and self.auth is None:
                    # slotgate needs /props for the slot count, and llama-server started with
                    # --api-key guards it: only the operator can give slotgate that key.
                    text = "llama-server wants an API key: set LLAMA_API_KEY to it"
                elif status == 404:
                    # Most often LLAMA_SERVER_URL is the OpenAI base URL, .../v1.
                    text = (
                        f"GET {self.url}/props found nothing; LLAMA_SERVER_URL is llama-server's "
                        "root URL, without /v1"
                    )
                raise ValueError(f"/props answered {status}: {text}")  # noqa: TRY301 - one handler for every way /props fails
            # orjson: too deep a nesting is a ValueError (json's RecursionError would end the
            # follower).
            data = orjson.loads(body)
            if isinstance(data, dict) and data.get("role") == "router" and self._routing:
                await self._follow_router(data)
                return
            props = Props.parse(data)
            if self.router is not None:
                # A router no more (restarted with a model): its children's slots are gone.
                log.info("llama-server is no longer a router url=%s", self.url)
                self.router.close()
                self.router = None
                self.ready = False
        except TimeoutError:
            if self.ready and self.answers != answers:
                # Busy, or slotgate's loop is late (a flood of clients on a starved CPU): a
                # server that answers is there, and marking it down would turn every waiter
                # into a 503 once STARTUP_WAIT_S ran out. It is read again at the next tick.
                log.info("llama-server was slow to answer /props while busy url=%s", self.url)
                return
            self._mark_not_ready(self.unreached or "TimeoutError()")
            return
        except (ExchangeFailed, ValueError) as exc:
            if isinstance(exc, ConnectFailed):
                self._not_reached(exc)
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else repr(exc)
            self._mark_not_ready(self.unreached or reason)
            return
        if self.props is not None and props.build_info != self.props.build_info:
            self._client.relearn()
            self.cors.forget()
        if self.props is None or props.total_slots != self.props.total_slots or not self.ready:
            log.info(
                "llama-server ready: total_slots=%d n_ctx=%s model=%s url=%s",
                props.total_slots, props.n_ctx, props.model, self.url,
            )  # fmt: skip
        if self.props is not None and (props.total_slots, props.n_ctx) != (
            self.props.total_slots,
            self.props.n_ctx,
        ):
            self.shared_cache_seen = False  # restarted with another -np or -c: learn afresh
        if not self.ready and self.pool.cold:
            await self._learn_speed()
        self.props = props
        became_ready = not self.ready
        self.ready = True
        self.reason = "ready"
        if became_ready and self._on_ready is not None:
            self._on_ready()
        # The budget first: the resize lets in whoever waited for the capacity, and they
        # must be weighed by the budget too.
        self.pool.resize_budget(self.kv_budget_tokens(props))
        self.pool.resize(props.total_slots)
        if (placed := self.model_pool) is not None:
            if props.model == self.placed_model:
                placed.resize_budget(self.kv_budget_tokens(props))
                placed.resize(props.total_slots)
            else:
                # Back with another model: nothing of its old model's line runs here; the
                # fleet places it in its new model's line (app/upstreams/fleet.py).
                placed.resize(None)

    async def _follow_router(self, props: dict[str, Any]) -> None:
        """It is a router: ready while it answers; its models' slots come from each child."""
        router = self.router
        if router is None:
            assert self._routing is not None  # noqa: S101 - checked by the caller
            router = self.router = self._routing(self)
            log.info("llama-server is a router (several models) url=%s", self.url)
            if self.pool.draining:
                router.drain()  # drained before it showed itself a router
            # Its slots are its children's now, not those of the server it may have been.
            self.props = None
            self.pool.resize(None)
            if self.model_pool is not None:
                self.model_pool.retire()
                self.model_pool = None
        if not self.ready:
            self.ready = True
            self.reason = "ready (router)"
            if self._on_ready is not None:
                self._on_ready()
        try:
            await router.refresh(props)
        except (ExchangeFailed, TimeoutError, ValueError) as exc:
            # The router answered its /props: it is there; its models are read again next time.
            log.warning("cannot follow the router's models: %r url=%s", exc, self.url)

    def kv_budget_tokens(self, props: Props) -> int | None:
        """The KV-cache tokens the slots share, when that binds admission; else None.

        llama-server shows neither its total context nor whether its cache is unified (not in
        /props, /slots, /metrics or /v1/models: each slot's n_ctx is the whole cache when
        unified and its share otherwise), so the budget is KV_BUDGET_TOKENS, which slotgate
        sets itself for an engine it starts. Unset, it binds once llama-server has been seen
        to run out of a shared cache (`check_failure`): then the slot's n_ctx is the whole cache.
        """
        configured = self._kv_budget_tokens
        if configured is None and self.shared_cache_seen:
            configured = props.n_ctx
        if not configured:
            return None
        if props.total_slots == 1:
            return None  # one request at a time: llama-server itself refuses what never fits
        return configured

    def check_failure(self, body: bytes) -> None:
        """A generation failed with 500: was it llama-server running out of a KV cache that its
        slots share? Only a unified cache fails that way (a slot of its own stops at its n_ctx),
        so from then on admission counts tokens, when KV_BUDGET_TOKENS left it to slotgate."""
        if self.shared_cache_seen or _CONTEXT_EXHAUSTED not in body:
            return
        self.learn_shared_cache()

    def learn_shared_cache(
        self, seen: str = "llama-server ran out of KV cache for the requests in flight"
    ) -> None:
        """Its slots share one KV cache: `seen` here, or by another replica sharing the line."""
        if self.shared_cache_seen:
            return
        self.shared_cache_seen = True
        if self._kv_budget_tokens is None and self.props is not None:
            budget = self.kv_budget_tokens(self.props)
            log.warning(
                "%s: its slots share one cache; admitting by a budget of %s tokens from now on "
                "(set KV_BUDGET_TOKENS to say so from the start)",
                seen,
                budget,
            )
            self.pool.resize_budget(budget)
            if self.model_pool is not None:
                self.model_pool.resize_budget(budget)

    @property
    def default_output(self) -> int | None:
        """llama-server's own output limit for a request that sets none (its -n), if known."""
        return self.props.n_predict if self.props is not None else None

    async def count(self, ticket: Claim, est: Estimate) -> None:
        """Have llama-server count the prompt of a request that holds `ticket` (admitted or in
        line), and cut its reservation to that; release it when the prompt can never fit."""
        try:
            exact = await counted(est, self.count_prompt)
        except BaseException:
            ticket.release()
            raise
        if exact is not None:
            ticket.recost(exact)

    async def count_prompt(self, chat: bool, payload: dict[str, Any]) -> int | None:
        """llama-server's own count of a prompt's tokens (a chat's after its template), or
        None when it cannot tell (a round trip that fails, an older server)."""
        # A router loads the model a POST names (and evicts another for it) unless told not
        # to: a count must never load what the swap rule keeps unloaded (app/gate/swaps.py).
        # Not loaded, it answers 400 and the local bound stands.
        query = "" if self.router is None else "?autoload=false"
        try:
            # One bound for both round trips: the request holds its place (or its slot) while
            # it is counted, and a count that comes late is worth less than the local bound.
            async with asyncio.timeout(self.count_timeout_s):
                if chat:
                    status, body = await self._post("/apply-template" + query, payload)
                    if status != 200:
                        return None
                    prompt = json.loads(body).get("prompt")
                else:
                    prompt = payload.get("prompt")
                if not isinstance(prompt, str):
                    return None
                request = {"content": prompt, "add_special": True, "parse_special": True}
                if isinstance(model := payload.get("model"), str):
                    request["model"] = model  # a router tokenizes with that model's child
                status, body = await self._post("/tokenize" + query, request)
            tokens = json.loads(body).get("tokens") if status == 200 else None
        except (ExchangeFailed, TimeoutError, ValueError, AttributeError, RecursionError):
            return None
        return len(tokens) if isinstance(tokens, list) else None

    async def _learn_speed(self) -> None:
        """llama-server's generation speed so far, for Retry-After before any hold is seen.

        Read once as llama-server becomes ready (with --metrics; else 501 and nothing learned):
        each read of /metrics restarts its throughput window, so it is not polled.
        """
        try:
            status, body = await self._get("/metrics")
        except (ExchangeFailed, TimeoutError):
            return
        if status == 200:
            self.tokens_per_s = generation_speed(body) or self.tokens_per_s

    def _mark_not_ready(self, reason: str) -> None:
        if self.ready or reason != self.reason:
            log.warning("llama-server not ready: %s url=%s", reason, self.url)
        self._client.relearn()  # what comes back may be another build
        self.cors.forget()
        self.verbose = None  # it may come back with another --verbose
        self.ready = False
        self.reason = reason
        self.pool.resize(None)
        if self.model_pool is not None:
            self.model_pool.resize(None)
        if self.router is not None:
            self.router.lost()

    async def _follow(self) -> None:
        while True:
            self._poke.clear()
            await self.refresh()
            if self.router is not None and self.router.awaiting:
                # A model loads for its line: its waiters are let in as soon as it is up.
                interval_s = STARTING_POLL_S
            elif self.ready:
                interval_s = self._refresh_s
            elif self.pool.awaiting_capacity:
                interval_s = STARTING_POLL_S
            else:
                interval_s = min(self._refresh_s, NOT_READY_RETRY_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval_s):
                    await self._poke.wait()
