"""Quotas for the fleet (REDIS_URL): each tenant's windows kept in Redis, checked and charged by
one script (app/replicas/lua/quota.lua, the rule of app/gate/quotas.py), by Redis's clock, so
that a tenant's limits hold whichever replica its requests come to.

While Redis does not answer, this replica counts on its own windows (`local`), as if it were
alone: a tenant may then use its limits once per replica cut off, and the tokens charged
meanwhile never reach the fleet's count. A quota's job is a budget, not a safety bound, so a
request is not refused for Redis being away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from slotgate.errors import Down, QuotaExceeded
from slotgate.gate.quotas import Quota, Standing, Windows
from slotgate.replicas.transport import Transport

log = logging.getLogger("slotgate.replicas")

#: Connections for quota calls, beside the shared line's own.
_CONNECTIONS = 4


class SharedWindows:
    """The fleet's quota windows in Redis; a `Ledger` (app/gate/quotas.py)."""

    def __init__(
        self, url: str, fleet: str, *, timeout_s: float, local: Windows | None = None
    ) -> None:
        prefix = f"slotgate:{{{fleet}}}:"
        self._redis = Transport(
            url, prefix, f"{prefix}quotas", timeout_s=timeout_s, max_connections=_CONNECTIONS,
            shared=lambda: True,
        )  # fmt: skip
        #: The windows this replica counts on while Redis is away.
        self.local = local or Windows()
        #: Charges under way: kept so that none is collected before it is done.
        self._charges: set[asyncio.Task[None]] = set()
        #: Set while counting alone, so that the fall-back is logged once, not per request.
        self._alone = False

    async def admit(self, name: str, quota: Quota) -> Standing:
        try:
            answer = await self.call(name, quota, -1)
        except Down as exc:
            self._fell_back(exc)
            return self.local.admit_now(name, quota)
        self._alone = False
        refused, standing = parsed(answer)
        if refused is not None:
            raise QuotaExceeded(name, refused, float(answer[1]), standing)
        return standing

    def charge(self, name: str, tokens: int) -> None:
        if tokens <= 0:
            return
        task = asyncio.get_running_loop().create_task(self._charge(name, tokens))
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    @property
    def pending(self) -> int:
        """Charges on their way to Redis."""
        return len(self._charges)

    async def _charge(self, name: str, tokens: int) -> None:
        try:
            await self.call(name, Quota(), tokens)
        except Down as exc:
            self._fell_back(exc)
            self.local.charge(name, tokens)

    async def call(
        self, name: str, quota: Quota, tokens: int, now: float | None = None
    ) -> Sequence[bytes]:
        """The script's answer for tenant `name`: admit (`tokens` -1) or charge; `now` (for
        tests) instead of Redis's clock. Raises Down."""
        args: list[str | int] = [name, *quota.numbers(), tokens, "" if now is None else repr(now)]
        answer: Sequence[bytes] = await self._redis.script("QUOTA", args)
        return answer

    def _fell_back(self, exc: Down) -> None:
        if not self._alone:
            log.warning("quotas counted by this replica alone while Redis is away: %s", exc)
        self._alone = True

    async def aclose(self) -> None:
        if self._charges:
            await asyncio.wait(self._charges, timeout=self._redis.timeout_s)
        await self._redis.aclose()


def parsed(answer: Sequence[bytes]) -> tuple[str | None, Standing]:
    """The script's answer to a check: the limit that refused (None: admitted) and the
    standing."""

    def limit(value: bytes) -> int | None:
        return int(value) if value else None

    refused = answer[0].decode() or None
    standing = Standing(
        limit(answer[2]), int(answer[3]), float(answer[4]),
        limit(answer[5]), int(answer[6]), float(answer[7]),
    )  # fmt: skip
    return refused, standing
