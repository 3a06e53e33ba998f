"""llama-server's CORS policy as slotgate learns it from llama-server's answers, in-process."""

from __future__ import annotations

from app.cors import MAX_ORIGINS, CorsPolicy

VARY = (b"vary", b"Origin")


def test_an_origin_gets_what_llama_server_last_gave_it_and_nothing_else() -> None:
    policy = CorsPolicy()
    assert policy.headers_for(None) == []
    assert policy.headers_for(b"http://a") == [VARY]  # never answered: nothing allowed
    policy.learn(b"http://a", [(b"access-control-allow-origin", b"http://a"),
                               (b"access-control-allow-credentials", b"true"),
                               (b"content-type", b"application/json")])  # fmt: skip
    assert policy.headers_for(b"http://a") == [(b"access-control-allow-origin", b"http://a"), VARY]
    policy.learn(b"http://a", [(b"content-type", b"application/json")])  # no longer allowed
    assert policy.headers_for(b"http://a") == [VARY]


def test_the_oldest_origin_is_forgotten_past_the_bound_and_all_on_a_restart() -> None:
    policy = CorsPolicy()
    origins = [b"http://%d" % i for i in range(MAX_ORIGINS + 1)]
    for origin in origins:
        policy.learn(origin, [(b"access-control-allow-origin", origin)])
    assert policy.headers_for(origins[0]) == [VARY]
    assert policy.headers_for(origins[-1]) == [(b"access-control-allow-origin", origins[-1]), VARY]
    policy.forget()
    assert policy.headers_for(origins[-1]) == [VARY]
