"""llama-server's CORS policy as slotgate learns it from llama-server's answers, in-process."""

from __future__ import annotations

import time

import pytest
from slotgate.cors import MAX_ORIGINS, TTL_S, CorsPolicy

VARY = (b"vary", b"Origin")


def allow(origin: bytes) -> tuple[bytes, bytes]:
    return (b"access-control-allow-origin", origin)


def test_an_origin_gets_what_llama_server_last_gave_it_and_nothing_else() -> None:
    policy = CorsPolicy()
    assert policy.headers_for(None) == []
    assert policy.headers_for(b"http://a") == [VARY]  # never answered: nothing allowed
    policy.learn(b"http://a", [allow(b"http://a"), (b"access-control-allow-credentials", b"true"),
                               (b"content-type", b"application/json")])  # fmt: skip
    assert policy.headers_for(b"http://a") == [allow(b"http://a"), VARY]
    # An allowlist answers another Origin with the allowed one: repeated as it is.
    policy.learn(b"http://a", [allow(b"http://trusted")])
    assert policy.headers_for(b"http://a") == [allow(b"http://trusted"), VARY]
    # An answer without the header (refused before llama-server's routing) teaches nothing.
    policy.learn(b"http://a", [(b"content-type", b"text/plain")])
    assert policy.headers_for(b"http://a") == [allow(b"http://trusted"), VARY]


def test_what_was_learned_lapses_unless_llama_server_says_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    policy = CorsPolicy()
    policy.learn(b"http://a", [allow(b"http://a")])
    now[0] += TTL_S - 1
    assert policy.headers_for(b"http://a") == [allow(b"http://a"), VARY]
    policy.learn(b"http://a", [allow(b"http://a")])
    now[0] += TTL_S - 1
    assert policy.headers_for(b"http://a") == [allow(b"http://a"), VARY]
    now[0] += 2
    assert policy.headers_for(b"http://a") == [VARY]


def test_the_oldest_origin_is_forgotten_past_the_bound_and_all_on_a_restart() -> None:
    policy = CorsPolicy()
    origins = [b"http://%d" % i for i in range(MAX_ORIGINS + 1)]
    for origin in origins:
        policy.learn(origin, [allow(origin)])
    assert policy.headers_for(origins[0]) == [VARY]
    assert policy.headers_for(origins[-1]) == [allow(origins[-1]), VARY]
    policy.forget()
    assert policy.headers_for(origins[-1]) == [VARY]
