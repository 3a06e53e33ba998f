"""Quotas per tenant in the core: fixed windows of the wall clock, checked at admission, tokens
charged when an answer ends."""

from __future__ import annotations

from pathlib import Path

import pytest
from slotgate.errors import InvalidTenantsFile, QuotaExceeded, refusal
from slotgate.gate.quotas import (
    DAY_S,
    EMPTY,
    MINUTE_S,
    Quota,
    Windows,
    charged,
    check,
)
from slotgate.gate.tenants import roster

from tests.support.clock import T0, Clock


async def test_a_tenant_past_its_requests_per_minute_is_refused_until_the_next_minute() -> None:
    clock = Clock()
    windows = Windows(clock)
    quota = Quota(requests_per_minute=2)
    first = await windows.admit("chat", quota)
    second = await windows.admit("chat", quota)
    assert (first.remaining_requests, second.remaining_requests) == (1, 0)
    assert second.reset_requests_s == pytest.approx(50.0)
    with pytest.raises(QuotaExceeded) as refused:
        await windows.admit("chat", quota)
    assert refused.value.limit == "requests_per_minute"
    assert refused.value.retry_after_s == pytest.approx(50.0)
    clock.now += 50.0
    assert (await windows.admit("chat", quota)).remaining_requests == 1


async def test_a_refused_request_is_not_counted() -> None:
    windows = Windows(Clock())
    quota = Quota(requests_per_minute=1)
    await windows.admit("chat", quota)
    for _ in range(3):
        with pytest.raises(QuotaExceeded):
            await windows.admit("chat", quota)
    assert windows.account("chat").requests == 1


async def test_tokens_are_checked_with_what_ended_answers_used() -> None:
    clock = Clock()
    windows = Windows(clock)
    quota = Quota(tokens_per_minute=100)
    await windows.admit("chat", quota)
    windows.charge("chat", 60)
    standing = await windows.admit("chat", quota)
    assert (standing.limit_tokens, standing.remaining_tokens) == (100, 40)
    windows.charge("chat", 60)  # the answer that crossed the limit is charged in full
    with pytest.raises(QuotaExceeded) as refused:
        await windows.admit("chat", quota)
    assert refused.value.limit == "tokens_per_minute"
    assert refused.value.standing.remaining_tokens == 0
    clock.now += MINUTE_S
    assert (await windows.admit("chat", quota)).remaining_tokens == 100


async def test_an_answer_under_way_counts_nothing_until_it_ends() -> None:
    windows = Windows(Clock())
    quota = Quota(tokens_per_minute=10)
    await windows.admit("chat", quota)
    # The first answer has not ended: a second request is let in.
    await windows.admit("chat", quota)
    windows.charge("chat", 10)
    with pytest.raises(QuotaExceeded):
        await windows.admit("chat", quota)


async def test_the_day_budget_outlives_the_minute_and_resets_at_midnight_utc() -> None:
    clock = Clock()
    windows = Windows(clock)
    quota = Quota(tokens_per_minute=1000, tokens_per_day=150)
    await windows.admit("chat", quota)
    windows.charge("chat", 100)
    clock.now += MINUTE_S
    standing = await windows.admit("chat", quota)
    # Per day binds first now: 50 left of it against 1000 of the minute.
    assert (standing.limit_tokens, standing.remaining_tokens) == (150, 50)
    assert standing.reset_tokens_s == pytest.approx(DAY_S - 10.0 - MINUTE_S)
    windows.charge("chat", 50)
    clock.now += MINUTE_S
    with pytest.raises(QuotaExceeded) as refused:
        await windows.admit("chat", quota)
    assert refused.value.limit == "tokens_per_day"
    clock.now = T0 - 10.0 + DAY_S
    assert (await windows.admit("chat", quota)).remaining_tokens == 150


def test_tenants_have_windows_of_their_own() -> None:
    windows = Windows(Clock())
    one = Quota(requests_per_minute=1)
    assert [windows.admit_now(name, one).remaining_requests for name in ("a", "b")] == [0, 0]
    with pytest.raises(QuotaExceeded):
        windows.admit_now("a", one)


async def test_new_limits_apply_to_the_windows_already_counted() -> None:
    windows = Windows(Clock())
    await windows.admit("chat", Quota(requests_per_minute=5))
    await windows.admit("chat", Quota(requests_per_minute=5))
    with pytest.raises(QuotaExceeded):
        await windows.admit("chat", Quota(requests_per_minute=2))


def test_a_standing_shows_only_the_limits_that_are_set() -> None:
    verdict = check(EMPTY, Quota(requests_per_minute=3), T0)
    assert verdict.standing.limit_requests == 3
    assert verdict.standing.limit_tokens is None
    verdict = check(charged(EMPTY, 5, T0), Quota(tokens_per_day=9), T0)
    assert verdict.standing.limit_requests is None
    assert (verdict.standing.limit_tokens, verdict.standing.remaining_tokens) == (9, 4)


def test_a_quota_refusal_is_a_429_naming_the_limit_with_retry_after() -> None:
    verdict = check(EMPTY._replace(minute=int(T0 // MINUTE_S), requests=1), Quota(1), T0)
    assert verdict.refused == "requests_per_minute"
    exc = QuotaExceeded("chat", verdict.refused, verdict.retry_after_s, verdict.standing)
    r = refusal(exc)
    assert (r.status, r.code, r.type, r.reason) == (429, "quota_exceeded", "rate_limit_error",
                                                    "quota_exceeded")  # fmt: skip
    assert r.retry_after_s == pytest.approx(50.0)
    assert "requests_per_minute" in r.message
    assert "1 requests per minute" in r.message
    assert r.extra == {"quota": "requests_per_minute"}


def test_the_keys_file_sets_a_tenants_quotas(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(
        '[tenants.chat]\nkey = "sk-chat"\nrequests_per_minute = 60\ntokens_per_day = 5000\n'
        '[tenants.free]\nkey = "sk-free"\n'
    )
    chat, free = roster(path=path).tenants
    assert chat.quota == Quota(requests_per_minute=60, tokens_per_day=5000)
    assert free.quota is None
    assert chat.lowered(0).quota == chat.quota


@pytest.mark.parametrize("value", ["0", "-1", "1.5", '"60"', "true"])
def test_a_quota_that_is_not_a_positive_whole_number_stops_start_up(
    tmp_path: Path, value: str
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'[tenants.chat]\nkey = "sk-chat"\ntokens_per_minute = {value}\n')
    with pytest.raises(InvalidTenantsFile, match="tokens_per_minute: must be a whole number"):
        roster(path=path)


def test_a_tenants_standing_is_read_for_each_limit_it_has() -> None:
    clock = Clock()
    quota = Quota(requests_per_minute=10, tokens_per_day=1000)
    windows = Windows(clock)
    windows.admit_now("chat", quota)
    windows.charge("chat", 300)
    assert windows.view("chat", quota) == {
        "requests_per_minute": {"limit": 10, "used": 1, "remaining": 9, "reset_s": 50.0},
        "tokens_per_day": {"limit": 1000, "used": 300, "remaining": 700, "reset_s": DAY_S - 10},
    }
    clock.now += 50.0  # a new minute: its requests start again, the day's tokens stay
    shown = windows.view("chat", quota)
    assert shown["requests_per_minute"]["used"] == 0
    assert shown["tokens_per_day"]["used"] == 300
    assert windows.view("idle", quota)["tokens_per_day"]["remaining"] == 1000
