"""llama-server's CORS policy as slotgate learns it from llama-server's answers, in-process."""

from __future__ import annotations

import time

import pytest
from slotgate.upstreams.cors import EXPOSED, MAX_ORIGINS, TTL_S, CorsPolicy

VARY = (b"vary", b"Origin")
EXPOSE = (b"access-control-expose-headers", b", ".join(EXPOSED))


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic clock, as the test moves it: now[0]."""
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    return clock


def allow(origin: bytes) -> tuple[bytes, bytes]:
    return (b"access-control-allow-origin", origin)


def test_an_origin_gets_what_llama_server_last_gave_it_and_nothing_else() -> None:
    policy = CorsPolicy()
    assert policy.headers_for(None) == []
    assert policy.headers_for(b"http://a") == [VARY]  # never answered: nothing allowed
    policy.learn(b"http://a", [allow(b"http://a"), (b"access-control-allow-credentials", b"true"),
                               (b"content-type", b"application/json")])  # fmt: skip
    assert policy.headers_for(b"http://a") == [allow(b"http://a"), EXPOSE, VARY]
    # An allowlist answers another Origin with the allowed one: repeated as it is.
    policy.learn(b"http://a", [allow(b"http://trusted")])
    assert policy.headers_for(b"http://a") == [allow(b"http://trusted"), EXPOSE, VARY]
    # An answer without the header (refused before llama-server's routing) teaches nothing.
    policy.learn(b"http://a", [(b"content-type", b"text/plain")])
    assert policy.headers_for(b"http://a") == [allow(b"http://trusted"), EXPOSE, VARY]


def test_what_was_learned_lapses_unless_llama_server_says_it_again(now: list[float]) -> None:
    policy = CorsPolicy()
    policy.learn(b"http://a", [allow(b"http://a")])
    now[0] += TTL_S - 1
    assert policy.headers_for(b"http://a") == [allow(b"http://a"), EXPOSE, VARY]
    policy.learn(b"http://a", [allow(b"http://a")])
    now[0] += TTL_S - 1
    assert policy.headers_for(b"http://a") == [allow(b"http://a"), EXPOSE, VARY]
    now[0] += 2
    assert policy.headers_for(b"http://a") == [VARY]


def test_a_flood_of_new_origins_never_evicts_one_still_live(now: list[float]) -> None:
    policy = CorsPolicy()
    live = b"http://app.example"
    policy.learn(live, [allow(live)])
    flood = [b"http://%d.example" % i for i in range(3 * MAX_ORIGINS)]
    for origin in flood:
        policy.learn(origin, [allow(origin)])
    # The table filled up and then refused newcomers: what it held stays.
    assert policy.headers_for(live) == [allow(live), EXPOSE, VARY]
    assert policy.headers_for(flood[MAX_ORIGINS - 2]) == [
        allow(flood[MAX_ORIGINS - 2]),
        EXPOSE,
        VARY,
    ]
    assert policy.headers_for(flood[MAX_ORIGINS - 1]) == [VARY]
    # An Origin already held is refreshed even when the table is full.
    now[0] += TTL_S / 2
    policy.learn(live, [allow(live)])
    # Once entries lapse, a newcomer takes the place of the oldest lapsed one, not a live one.
    now[0] += TTL_S / 2 + 1
    newcomer = b"http://new.example"
    policy.learn(newcomer, [allow(newcomer)])
    assert policy.headers_for(newcomer) == [allow(newcomer), EXPOSE, VARY]
    assert policy.headers_for(live) == [allow(live), EXPOSE, VARY]


def test_everything_is_forgotten_on_a_restart() -> None:
    policy = CorsPolicy()
    origins = [b"http://%d" % i for i in range(MAX_ORIGINS)]
    for origin in origins:
        policy.learn(origin, [allow(origin)])
    assert policy.headers_for(origins[-1]) == [allow(origins[-1]), EXPOSE, VARY]
    policy.forget()
    assert policy.headers_for(origins[-1]) == [VARY]


def test_a_relayed_answer_exposes_slotgates_headers_merged_into_llama_servers_own() -> None:
    theirs = [allow(b"http://a"), (b"access-control-expose-headers", b"X-A, Request-Id")]
    CorsPolicy.expose(theirs)
    assert theirs[1] == (
        b"access-control-expose-headers",
        b"X-A, Request-Id, retry-after, retry-after-ms, x-should-retry, x-request-id",
    )
    bare = [allow(b"http://a"), (b"content-type", b"text/plain")]
    CorsPolicy.expose(bare)
    assert bare[2] == EXPOSE
    unallowed = [(b"content-type", b"text/plain")]
    CorsPolicy.expose(unallowed)
    assert unallowed == [(b"content-type", b"text/plain")]
