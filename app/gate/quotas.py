"""Quotas per tenant: requests per minute, tokens per minute and tokens per day (API_KEYS_FILE).

Standard library only. Each limit counts in a fixed window of the wall clock: the minute
(`requests_per_minute`, `tokens_per_minute`) and the day, in UTC (`tokens_per_day`). Fixed
windows, not sliding ones, because they are two integers per window, the same in this process
and in a Redis script (app/replicas/lua/quota.lua, for a fleet), and their reset is one time that
a client can be told (`Retry-After`, `x-ratelimit-reset-*`).

A request is counted when it passes the check (`admit`), before it waits for a slot; its tokens
(prompt and completion, as llama-server's answer reports them) are charged when its answer
ends (`charge`), to the windows of that moment. An answer still under way counts nothing yet:
it is not known how long it will be (a `max_tokens` reservation would charge most answers far
more than they use, and nothing at all bounds one without it). So the check lets a request in
while the tokens used so far are below the limit, and a client that sends one request at a
time overshoots by its last answer's tokens at most; concurrent requests of one tenant may
overshoot by the answers they have in flight when the limit is reached.

The windows are kept by tenant name, apart from the roster: a reload (SIGHUP) that keeps a
tenant keeps its windows and puts its new limits in force for its next request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from slotgate.errors import QuotaExceeded

MINUTE_S = 60
DAY_S = 86400

#: The limits, by the name a refusal and the keys file give each.
REQUESTS_PER_MINUTE = "requests_per_minute"
TOKENS_PER_MINUTE = "tokens_per_minute"
TOKENS_PER_DAY = "tokens_per_day"
LIMITS = (REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE, TOKENS_PER_DAY)
#: The largest limit the keys file takes: the Redis script counts in doubles and writes its
#: numbers back with 14 significant digits, so a count from 10**14 would come back as "1e+14".
MAX_LIMIT = 10**12


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits; None: that one is not limited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    def numbers(self) -> tuple[int, int, int]:
        """The three limits with 0 for none, as the Redis script takes them."""
        return (
            self.requests_per_minute or 0,
            self.tokens_per_minute or 0,
            self.tokens_per_day or 0,
        )


class Standing(NamedTuple):
    """Where a tenant stands after a check, for the `x-ratelimit-*` headers: each limit (None:
    none), what is left of it and the seconds until its window resets. The tokens' trio is
    the limit that binds first: the one with less left (per minute on a tie)."""

    limit_requests: int | None
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int | None
    remaining_tokens: int
    reset_tokens_s: float


class Account(NamedTuple):
    """One tenant's windows: the minute's number (since the epoch) with its requests and
    tokens, and the day's number with its tokens."""

    minute: int
    requests: int
    minute_tokens: int
    day: int
    day_tokens: int


EMPTY = Account(0, 0, 0, 0, 0)


class Verdict(NamedTuple):
    """A check's outcome: the limit that refused (None: admitted), the account after it, and
    the standing to show."""

    refused: str | None
    retry_after_s: float
    account: Account
    standing: Standing


def current(account: Account, now: float) -> Account:
    """The account with the windows `now` falls in: a new minute or day starts at 0."""
    minute, day = int(now // MINUTE_S), int(now // DAY_S)
    if account.minute != minute:
        account = Account(minute, 0, 0, account.day, account.day_tokens)
    if account.day != day:
        account = Account(account.minute, account.requests, account.minute_tokens, day, 0)
    return account


def check(account: Account, quota: Quota, now: float) -> Verdict:
    """Admit a request (count it) or refuse it, naming the first limit reached: requests per
    minute, tokens per minute, tokens per day. The Redis script (quota.lua) is this function."""
    rpm, tpm, tpd = quota.numbers()
    account = current(account, now)
    minute_left = (account.minute + 1) * MINUTE_S - now
    day_left = (account.day + 1) * DAY_S - now
    refused: str | None = None
    retry_after_s = 0.0
    if rpm and account.requests >= rpm:
        refused, retry_after_s = REQUESTS_PER_MINUTE, minute_left
    elif tpm and account.minute_tokens >= tpm:
        refused, retry_after_s = TOKENS_PER_MINUTE, minute_left
    elif tpd and account.day_tokens >= tpd:
        refused, retry_after_s = TOKENS_PER_DAY, day_left
    else:
        account = account._replace(requests=account.requests + 1)
    return Verdict(refused, retry_after_s, account, standing(account, quota, now))


def charged(account: Account, tokens: int, now: float) -> Account:
    """The account with an ended answer's tokens added to the windows of `now`."""
    account = current(account, now)
    return account._replace(
        minute_tokens=account.minute_tokens + tokens, day_tokens=account.day_tokens + tokens
    )


def standing(account: Account, quota: Quota, now: float) -> Standing:
    rpm, tpm, tpd = quota.numbers()
    minute_left = (account.minute + 1) * MINUTE_S - now
    day_left = (account.day + 1) * DAY_S - now
    tokens: tuple[int | None, int, float] = (None, 0, 0.0)
    if tpm:
        tokens = (tpm, max(tpm - account.minute_tokens, 0), minute_left)
    if tpd and (not tpm or tpd - account.day_tokens < tokens[1]):
        tokens = (tpd, max(tpd - account.day_tokens, 0), day_left)
    return Standing(
        rpm or None, max(rpm - account.requests, 0), minute_left if rpm else 0.0, *tokens
    )


def view(account: Account, quota: Quota, now: float) -> dict[str, dict[str, float | int]]:
    """Each limit that is set, with what its window holds (`used`), what is `left` of it and
    the seconds until it resets (`reset_s`), for /admission: read when asked, never kept."""
    account = current(account, now)
    minute_left = round((account.minute + 1) * MINUTE_S - now, 3)
    day_left = round((account.day + 1) * DAY_S - now, 3)
    windows = (
        (REQUESTS_PER_MINUTE, quota.requests_per_minute, account.requests, minute_left),
        (TOKENS_PER_MINUTE, quota.tokens_per_minute, account.minute_tokens, minute_left),
        (TOKENS_PER_DAY, quota.tokens_per_day, account.day_tokens, day_left),
    )
    return {
        name: {"limit": limit, "used": used, "remaining": max(limit - used, 0), "reset_s": reset}
        for name, limit, used, reset in windows
        if limit is not None
    }


class Ledger(Protocol):
    """Where the windows are kept: in this process (`Windows`), or for the fleet in Redis."""

    async def admit(self, name: str, quota: Quota) -> Standing:
        """Count a request of tenant `name`, or raise QuotaExceeded."""
        ...

    def charge(self, name: str, tokens: int) -> None:
        """An answer of tenant `name` ended having used `tokens`."""

    async def aclose(self) -> None:
        """Once the requests have ended."""


class Windows:
    """Every tenant's windows in this process. One dict entry per tenant that has a quota and
    sent a request: bounded by the keys file."""

    __slots__ = ("_accounts", "clock")

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        #: The wall clock the windows follow (the day is UTC's).
        self.clock = clock
        self._accounts: dict[str, Account] = {}

    async def admit(self, name: str, quota: Quota) -> Standing:
        return self.admit_now(name, quota)

    def admit_now(self, name: str, quota: Quota) -> Standing:
        verdict = check(self._accounts.get(name, EMPTY), quota, self.clock())
        if verdict.refused is not None:
            raise QuotaExceeded(name, verdict.refused, verdict.retry_after_s, verdict.standing)
        self._accounts[name] = verdict.account
        return verdict.standing

    def charge(self, name: str, tokens: int) -> None:
        if tokens > 0:
            self._accounts[name] = charged(self._accounts.get(name, EMPTY), tokens, self.clock())

    async def aclose(self) -> None:
        return

    def account(self, name: str) -> Account:
        """The tenant's windows as they stand now."""
        return current(self._accounts.get(name, EMPTY), self.clock())

    def view(self, name: str, quota: Quota) -> dict[str, dict[str, float | int]]:
        """The tenant's standing against each of its limits now (`view`)."""
        return view(self._accounts.get(name, EMPTY), quota, self.clock())
