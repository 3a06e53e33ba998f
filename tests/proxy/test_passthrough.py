"""Everything slotgate does not own reaches llama-server unchanged, and only llama-server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from slotgate.gate.tenants import label

from tests.conftest import GateFactory, RunningGate, chat
from tests.support.standin import StandIn


async def raw_request(port: int, request: bytes) -> bytes:
    """Send bytes exactly as given (clients normalise paths; attackers do not)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    try:
        async with asyncio.timeout(5):
            return await reader.read(65536)
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


async def test_other_paths_pass_through_with_method_query_and_body(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    response = await client.put(gate.url + "/lora-adapters?x=1&y=%20z", content=b"payload")
    assert response.status_code == 200
    assert response.headers["x-standin"] == "echo"
    assert response.json() == {
        "method": "PUT", "path": "/lora-adapters", "query": "x=1&y=%20z", "body": "payload",
    }  # fmt: skip


async def test_tokenize_is_never_queued(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(max_queue=1)
    busy = [asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat()))]
    await gate.until(lambda: gate.service.admission.active == 1)
    busy.append(asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat())))
    await gate.until(lambda: gate.service.admission.queued == 1)
    # The line is full, yet non-generating endpoints answer at once.
    assert (await client.post(gate.url + "/tokenize", json={"content": "hi"})).status_code == 200
    assert (await client.get(gate.url + "/health")).status_code == 200
    standin.hurry()
    await asyncio.gather(*busy)


async def test_hop_by_hop_headers_are_dropped_and_host_is_rewritten(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    await client.post(
        gate.url + "/tokenize",
        content=b"{}",
        headers={
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=5",
            "TE": "trailers",
            "Proxy-Authorization": "Basic eA==",
            "Host": "evil.example",
            "X-Custom": "kept",
            "Authorization": "Bearer client-key",
        },
    )
    seen = {k.lower(): v for k, v in standin.seen[-1].headers.items()}
    assert seen["host"] == f"127.0.0.1:{standin.port}"
    assert seen["x-custom"] == "kept"
    # Without keys of its own, slotgate is transparent to a llama-server run with --api-key.
    assert seen["authorization"] == "Bearer client-key"
    for dropped in ("x-secret-hop", "keep-alive", "te", "proxy-authorization"):
        assert dropped not in seen


async def test_conversation_id_is_stripped_unless_the_operator_opts_in(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    strict = await start_gate()
    await client.post(
        strict.url + "/v1/chat/completions", json=chat(), headers={"X-Conversation-Id": "c1"}
    )
    assert "x-conversation-id" not in {k.lower() for k in standin.seen[-1].headers}
    lenient = await start_gate(forward_conversation_id=True)
    await client.post(
        lenient.url + "/v1/chat/completions", json=chat(), headers={"X-Conversation-Id": "c1"}
    )
    assert {k.lower(): v for k, v in standin.seen[-1].headers.items()}["x-conversation-id"] == "c1"


def plain_get(target: bytes) -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.mark.parametrize(
    "request_bytes",
    [
        *(
            pytest.param(plain_get(target), id=f"dot-segments:{target.decode()}")
            for target in [
                b"/../props",
                b"/v1/../../etc/passwd",
                b"/%2e%2e/props",
                b"/v1/%2E%2E/x",
                b"/./props",
                b"/a\\..\\b",
            ]
        ),
        # Encoded slashes cannot slip a generation past the gate: the decoded path is the chat
        # route, so the gate checks it like one (and its body is no JSON).
        pytest.param(
            b"POST /v1%2Fchat%2fcompletions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: 9\r\n\r\n{not json",
            id="encoded-slashes",
        ),
        # Conflicting length headers are refused, not smuggled.
        pytest.param(
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            b"GET /props HTTP/1.1\r\nHost: x\r\n\r\n",
            id="conflicting-lengths",
        ),
    ],
)
async def test_requests_that_could_slip_past_are_refused_before_anything_is_forwarded(
    start_gate: GateFactory, standin: StandIn, request_bytes: bytes
) -> None:
    gate = await start_gate()
    assert status_of(await raw_request(gate.port, request_bytes)) == 400
    assert standin.seen == []


async def test_absolute_form_target_cannot_choose_another_host(
    start_gate: GateFactory, standin: StandIn
) -> None:
    gate = await start_gate()
    response = await raw_request(
        gate.port,
        b"GET http://evil.example:9/tokenize?q=1 HTTP/1.1\r\nHost: evil.example\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert status_of(response) == 200
    assert standin.seen[-1].path == "/tokenize"
    assert standin.seen[-1].headers["Host"] == f"127.0.0.1:{standin.port}"


async def test_api_keys_guard_every_route_but_the_probes(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="k1,k2")
    for path in ("/admission", "/metrics", "/v1/models", "/tokenize"):
        response = await client.get(gate.url + path)
        assert response.status_code == 401, path
        assert response.json()["error"]["type"] == "authentication_error"
    denied = await client.post(
        gate.url + "/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer nope"}
    )
    assert denied.status_code == 401
    for path in ("/healthz", "/readyz", "/health"):
        assert (await client.get(gate.url + path)).status_code == 200, path
    assert standin.seen == []
    ok = await client.post(
        gate.url + "/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer k2"}
    )
    assert ok.status_code == 200
    ok = await client.get(gate.url + "/admission", headers={"X-Api-Key": "k1"})
    assert ok.status_code == 200


@pytest.mark.parametrize("admission_control", [True, False], ids=["gated", "ungated"])
async def test_refusals_before_the_body_is_read_count_under_their_route_in_its_shape(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, admission_control: bool
) -> None:
    gate = await start_gate(api_keys="k1", max_body_bytes=1000, admission_control=admission_control)
    messages = {"model": "m", "max_tokens": 5, "messages": []}
    denied = await client.post(gate.url + "/v1/messages", json=messages)
    assert denied.status_code == 401
    assert denied.json()["type"] == "error"  # Anthropic's shape on Anthropic's route
    assert denied.json()["error"]["type"] == "authentication_error"
    assert (await client.post(gate.url + "/v1/chat/completions", json=chat())).status_code == 401
    key = {"Authorization": "Bearer k1"}
    too_big = await client.post(
        gate.url + "/v1/chat/completions", json=chat(padding="x" * 2000), headers=key
    )
    assert too_big.status_code == 413
    metrics = (await client.get(gate.url + "/metrics", headers=key)).text
    # With keys, series carry the tenant: none before the key was known, else the key's.
    for reason, family, tenant in (("unauthorized", "messages", ""),
                                   ("unauthorized", "chat", ""),
                                   ("bad_request", "chat", label(b"k1"))):  # fmt: skip
        line = (
            f'slotgate_requests_rejected_total{{family="{family}",reason="{reason}",'
            f'tenant="{tenant}"}} 1.0'
        )
        assert line in metrics
    assert standin.seen == []


async def test_a_checked_key_is_never_forwarded_upstream(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="k1")
    await client.post(
        gate.url + "/v1/chat/completions", json=chat(),
        headers={"Authorization": "Bearer k1", "Connection": "authorization", "X-Api-Key": "k1"},
    )  # fmt: skip
    seen = {k.lower() for k in standin.seen[-1].headers}
    assert "authorization" not in seen
    assert "x-api-key" not in seen


async def test_the_upstream_key_replaces_the_clients_credentials(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(llama_api_key="upstream-secret")
    await client.post(
        gate.url + "/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer mine"}
    )
    seen = {k.lower(): v for k, v in standin.seen[-1].headers.items()}
    assert seen["authorization"] == "Bearer upstream-secret"
    # /props, read for the capacity, carries it too.
    assert gate.service.upstream.ready


async def test_cors_answers_of_llama_server_pass_through_once(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    response = await client.options(gate.url + "/v1/models", headers={"Origin": "http://a.example"})
    assert response.status_code == 200
    assert response.headers.get_list("access-control-allow-origin") == ["http://a.example"]


ORIGIN = {"Origin": "http://a.example"}


def allowed_origins(response: httpx.Response) -> list[str]:
    return response.headers.get_list("access-control-allow-origin")


async def hold_the_one_slot(
    gate: RunningGate, standin: StandIn, client: httpx.AsyncClient
) -> asyncio.Task[httpx.Response]:
    """From here on a generation holds the stand-in's one slot for 1 s: one that does, once
    it does."""
    standin.token_delay_s = 0.05
    running = asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat()))
    await gate.until(lambda: gate.service.admission.active == 1)
    return running


async def test_answers_slotgate_makes_carry_the_cors_header_llama_server_gave_the_origin(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 20, 0
    gate = await start_gate(max_queue=1, keepalive_interval_s=5, stream_head_after_s=0)
    # The answer is assembled from llama-server's stream, and keeps its CORS header: from it
    # slotgate learns what llama-server gives this Origin.
    assembled = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=ORIGIN)
    assert assembled.status_code == 200
    assert allowed_origins(assembled) == ["http://a.example"]
    assert assembled.headers["content-type"].startswith("application/json")
    running = await hold_the_one_slot(gate, standin, client)
    # A stream that must wait gets its head from slotgate...
    async with client.stream(
        "POST", gate.url + "/v1/chat/completions", json=chat(stream=True), headers=ORIGIN
    ) as waiting:
        assert allowed_origins(waiting) == ["http://a.example"]
        await gate.until(lambda: gate.service.admission.queued == 1)
        # ...and so does the 429 for the line that is full.
        refused = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=ORIGIN)
        assert refused.status_code == 429
        assert allowed_origins(refused) == ["http://a.example"]
        assert refused.headers["vary"] == "Origin"
        # An Origin llama-server never answered gets nothing it could read.
        unknown = await client.post(
            gate.url + "/v1/chat/completions", json=chat(), headers={"Origin": "http://b.example"}
        )
        assert unknown.status_code == 429
        assert allowed_origins(unknown) == []
        standin.hurry()
        await waiting.aread()
    await running
    unasked = await client.post(gate.url + "/v1/chat/completions", content=b"{")
    assert unasked.status_code == 400
    assert allowed_origins(unasked) == []  # no Origin, nothing echoed


def exposed(response: httpx.Response) -> list[str]:
    """The headers a page on another origin may read, from the one Expose-Headers line."""
    (line,) = response.headers.get_list("access-control-expose-headers") or [""]
    return [name.strip().lower() for name in line.split(",") if name.strip()]


OWN = ["retry-after", "retry-after-ms", "x-should-retry", "x-request-id", "request-id"]


async def test_a_page_on_another_origin_may_read_retry_after_and_the_request_id(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 5, 0
    gate = await start_gate(max_queue=1)
    # Relayed answers (assembled, streamed, passed through) carry slotgate's request id.
    assembled = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=ORIGIN)
    streamed = await client.post(
        gate.url + "/v1/chat/completions", json=chat(stream=True), headers=ORIGIN
    )
    listed = await client.get(gate.url + "/v1/models", headers=ORIGIN)
    for answer in (assembled, streamed, listed):
        assert answer.status_code == 200
        assert {"x-request-id", "request-id"} <= set(exposed(answer))
    standin.token_delay_s = 0.05
    running = [
        asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat()))
        for _ in range(2)
    ]
    await gate.until(lambda: gate.service.admission.queued == 1)
    refused = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=ORIGIN)
    assert refused.status_code == 429
    assert exposed(refused) == OWN
    # An Origin llama-server never answered is allowed nothing, so nothing is exposed either.
    other = await client.post(
        gate.url + "/v1/chat/completions", json=chat(), headers={"Origin": "http://b.example"}
    )
    assert exposed(other) == []
    await asyncio.gather(*running)
    # An upstream that exposes headers of its own keeps them, in the one line, none twice.
    standin.cors_expose = b"X-Upstream-Thing, X-Request-Id"
    merged = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=ORIGIN)
    assert exposed(merged)[:2] == ["x-upstream-thing", "x-request-id"]
    assert sorted(exposed(merged)) == sorted({"x-upstream-thing", *OWN})
    unasked = await client.get(gate.url + "/v1/models")
    assert "access-control-expose-headers" not in unasked.headers


async def test_slotgate_never_allows_an_origin_llama_servers_allowlist_refuses(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.cors_origins = {"http://trusted.example"}  # as llama-server --cors-origins
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 20, 0
    gate = await start_gate(max_queue=0, keepalive_interval_s=1, stream_head_after_s=0)
    evil = {"Origin": "http://evil.example"}
    first = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=evil)
    assert allowed_origins(first) == ["http://trusted.example"]  # llama-server's own answer
    running = await hold_the_one_slot(gate, standin, client)
    # The head of a waiting stream is slotgate's: it must not open what llama-server closed.
    async with client.stream(
        "POST", gate.url + "/v1/chat/completions", json=chat(stream=True), headers=evil
    ) as waiting:
        assert allowed_origins(waiting) == ["http://trusted.example"]
        assert gate.service.admission.queued == 1  # the head was slotgate's: the stream waits
        standin.hurry()
        await waiting.aread()
    await running


async def test_the_origin_slotgate_decides_by_is_the_one_llama_server_sees(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    two = [("Origin", "http://a.example"), ("Origin", "http://b.example")]
    refused = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=two)
    assert refused.status_code == 400
    assert "Origin" in refused.json()["error"]["message"]
    assert standin.seen == []
    # Named in Connection, it would be dropped on the way: it is not.
    await client.post(
        gate.url + "/v1/chat/completions", json=chat(),
        headers={**ORIGIN, "Connection": "keep-alive, origin"},
    )  # fmt: skip
    assert standin.seen[-1].headers["Origin"] == "http://a.example"


async def test_a_preflight_needs_no_key_as_browsers_send_none(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="k1")
    preflight = await client.options(
        gate.url + "/v1/chat/completions",
        headers={**ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    assert allowed_origins(preflight) == ["http://a.example"]
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert [seen.method for seen in standin.seen] == ["OPTIONS"]
    # Without a key it is a preflight or nothing: a body does not pass.
    laden = await client.request(
        "OPTIONS", gate.url + "/v1/chat/completions", content=b"x" * 1000, headers=ORIGIN
    )
    assert laden.status_code == 400
    assert laden.json()["error"]["type"] == "invalid_request_error"
    assert len(standin.seen) == 1
    denied = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=ORIGIN)
    assert denied.status_code == 401
    # Nothing learned from a keyless preflight, which anyone may send; from a keyed request, yes.
    assert allowed_origins(denied) == []
    keyed = {**ORIGIN, "Authorization": "Bearer k1"}
    assert (
        await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=keyed)
    ).status_code == 200
    denied = await client.post(gate.url + "/v1/chat/completions", json=chat(), headers=ORIGIN)
    assert allowed_origins(denied) == ["http://a.example"]


async def test_llama_server_sees_the_request_id_the_client_and_the_log_see(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    for given in ("bad id!", "req-7"):
        response = await client.post(
            gate.url + "/v1/chat/completions", json=chat(), headers={"X-Request-Id": given}
        )
        ours = response.headers["x-request-id"]
        assert (ours == given) == (given == "req-7")
        upstream = {k.lower(): v for k, v in standin.seen[-1].headers.items()}
        assert upstream["x-request-id"] == ours
