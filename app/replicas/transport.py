"""The shared line's link to Redis or Valkey: one bounded connection pool, the scripts called by
name (app/replicas/lua/), the subscription the grants arrive on, and a ping. Every failure is
`Down`; whether Redis refused (it is down for every replica) or merely did not answer is noted
in `refused`. It knows nothing of tickets or of the line's policy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from slotgate.errors import Down
from slotgate.replicas import lua


class Transport:
    """Calls to one fleet's scripts, each timed to `timeout_s`; the grants of one replica's
    channel handed to `subscribe`'s callback."""

    def __init__(
        self,
        url: str,
        prefix: str,
        channel: str,
        *,
        timeout_s: float,
        max_connections: int,
        shared: Callable[[], bool],
    ) -> None:
        self.prefix = prefix
        self.channel = channel
        self.timeout_s = timeout_s
        #: Is the replica in shared mode (a connection closed then is Redis's doing)?
        self._shared = shared
        self.client: aioredis.Redis = aioredis.Redis.from_pool(
            aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections + 2,
                timeout=timeout_s,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                # Fail fast: a retry would only stretch the time before degrading.
                retry=Retry(NoBackoff(), 0),
            )
        )
        # The pool has two more: the grants' subscription and the recovery ping.
        self.calls = asyncio.Semaphore(max_connections)
        #: Redis refused or closed a connection since it last answered: it is down (for every
        #: replica), not out of reach from this one alone.
        self.refused = False
        #: The pool's connections may be to a Redis that has since restarted.
        self.stale = False
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None

    # -- calls -------------------------------------------------------------------------------

    async def script(self, name: str, args: Sequence[str | int | float]) -> Any:
        """Call one of the library's functions, POLICY's numbers first; Down if Redis is not
        usable as it is."""
        function = lua.FUNCTIONS[name]
        policy = lua.POLICY
        client = self.client
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    return await client.fcall(function, 1, self.prefix, *policy, *args)
                except ResponseError as exc:
                    # Not loaded yet, or Redis restarted empty: load the library, call again.
                    if "function not found" not in str(exc).lower():
                        raise
                    await client.function_load(lua.LIBRARY, replace=True)
                    return await client.fcall(function, 1, self.prefix, *policy, *args)
        except (RedisError, OSError, TimeoutError) as exc:
            # A script error too (ResponseError): Redis is not usable as it is, so gate
            # locally rather than fail requests; `last_error` says why.
            self.heard(exc)
            raise Down(f"{name}: {exc!r}") from exc

    async def answers(self) -> bool:
        """Does Redis answer a ping (within `timeout_s`)?"""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.client.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self.heard(exc)
            return False
        return True

    def heard(self, exc: BaseException) -> None:
        """Note whether Redis's host refused a connection, or closed one in shared mode (a
        connection closed later may be this replica's own doing: `renew` drops the pool)."""
        if not self.refused:
            self.refused = _refused(exc, closed=self._shared())

    async def renew(self) -> None:
        """Connections to a Redis that restarted fail one by one when next used: start over,
        so that a rejoin is not followed by a second fallback."""
        if not self.stale:
            return
        self.stale = False
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                await self.client.connection_pool.disconnect()

    # -- the grants' channel -------------------------------------------------------------------

    @property
    def listening(self) -> bool:
        return self._listener is not None and not self._listener.done()

    @property
    def listener(self) -> asyncio.Task[None] | None:
        return self._listener

    async def subscribe(
        self, on_message: Callable[[str], None], on_lost: Callable[[BaseException], None]
    ) -> None:
        """Listen to the channel: each message to `on_message`, a lost subscription to
        `on_lost`; Down if the subscription is not made."""
        await self.unsubscribe()
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            async with asyncio.timeout(self.timeout_s):
                await pubsub.subscribe(self.channel)
        except (RedisError, OSError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                # Typed from redis-py 8 on, untyped before it: the ignore serves both.
                await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
            raise Down(f"SUBSCRIBE: {exc!r}") from exc
        self._pubsub = pubsub
        self._listener = asyncio.create_task(
            _listen(pubsub, on_message, on_lost), name="slotgate-shared-grants"
        )

    async def unsubscribe(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None and listener is not asyncio.current_task():
            await stop((listener,), self.timeout_s)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await pubsub.aclose()

    async def aclose(self) -> None:
        await self.unsubscribe()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                await self.client.aclose()


async def _listen(
    pubsub: Any, on_message: Callable[[str], None], on_lost: Callable[[BaseException], None]
) -> None:
    try:
        async for message in pubsub.listen():
            if message["type"] == "message":
                on_message(message["data"].decode())
    except (RedisError, OSError) as exc:
        on_lost(exc)


async def stop(tasks: Sequence[asyncio.Task[Any] | None], within_s: float) -> None:
    """Cancel `tasks` and wait until they end, `within_s` at most. Not `await task`: a task
    that turns its cancellation into an error (as a Redis client may) would go on, and an
    `await` on it inside `suppress(CancelledError)` would swallow the caller's own."""
    live = [task for task in tasks if task is not None and not task.done()]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live, timeout=within_s)
    for task in live:
        if task.done() and not task.cancelled():
            task.exception()  # seen: an error of a task being stopped says nothing more


def _refused(exc: BaseException, closed: bool) -> bool:
    """Did Redis's host refuse a connection (or close one, if `closed` counts): stopped or
    restarting, as opposed to not answering (slow, or out of reach from here alone)?"""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        if closed and isinstance(seen, RedisConnectionError) and "closed by server" in str(seen):
            return True
        if closed and isinstance(seen, ConnectionResetError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


__all__ = ["Transport", "stop"]
