"""The request path with one line per model (app/proxy/relay.py): a request's model picks its
line and its upstream; what the router would refuse is refused in the route's own shape."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from slotgate.intake import body
from slotgate.intake.body import OFF_LOOP_BYTES
from slotgate.intake.endpoints import parse_json

from tests.conftest import CHAT, GatesFor, MakeRouter, StartUpstreams, chat
from tests.support.router import children, hosted
from tests.support.standin import StandIn


async def test_an_unknown_model_is_refused_in_anthropics_shape_on_messages(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2)})
    gate = await gate_before(upstream)
    body = {"model": "gamma", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    answer = await client.post(gate.url + "/v1/messages", json=body)
    assert answer.status_code == 400
    assert answer.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "model 'gamma' not found",
            "code": "model_not_found",
        },
    }


async def test_autoload_zero_is_read_as_llama_server_reads_it(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")}, models_autoload=False)
    gate = await gate_before(upstream)
    refused = await client.post(gate.url + CHAT + "?autoload=0", json=chat(model="alpha"))
    assert refused.status_code == 400
    # `?autoload=1` on a router started without autoload loads, as the router would.
    served = await client.post(gate.url + CHAT + "?autoload=1", json=chat(model="alpha"))
    assert served.status_code == 200
    assert children(upstream)["alpha"].finished == 1


async def test_a_get_naming_a_model_goes_to_an_upstream_that_serves_it(
    router: MakeRouter,
    gates_for: GatesFor,
    start_upstreams: StartUpstreams,
    client: httpx.AsyncClient,
) -> None:
    other = StandIn(model="other.gguf")
    await start_upstreams(other)
    routed = await router({"alpha": hosted(3)})
    gate = await gates_for([other, routed])
    lanes = gate.service.models
    await gate.until(lambda: (found := lanes.find("alpha")) is not None and found.running)
    props = (await client.get(gate.url + "/props?model=alpha")).json()
    assert props["total_slots"] == 3  # the router's child, not the first upstream
    plain = (await client.get(gate.url + "/props")).json()
    assert plain["model_path"] == "other.gguf"


async def test_a_child_that_answers_503_sends_its_request_back_to_its_line_only(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(1), "beta": hosted(1)})
    gate = await gate_before(upstream)
    lanes = gate.service.models
    alpha = children(upstream)["alpha"]
    alpha.loading = True  # answers 503 "Loading model", as a child still loading does
    waiting = asyncio.create_task(client.post(gate.url + CHAT, json=chat(model="alpha")))
    await gate.until(lambda: not next(iter(lanes)).running)
    # The router is still ready, and so is beta's line: only alpha's request waits.
    assert gate.service.upstream.ready
    assert (await client.post(gate.url + CHAT, json=chat(model="beta"))).status_code == 200
    alpha.loading = False
    assert (await waiting).status_code == 200


@pytest.mark.interpreted
async def test_a_big_bodys_model_is_read_off_the_event_loop(
    router: MakeRouter,
    gate_before: GatesFor,
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upstream = await router({"alpha": hosted(2)})
    gate = await gate_before(upstream)
    parsed: list[int] = []

    def counted(body: bytes) -> dict[str, Any]:
        parsed.append(len(body))
        return parse_json(body)

    # Every parse of a body on the loop goes through here (in the worker process, it does not).
    monkeypatch.setattr(body, "parse_json", counted)
    small = await client.post(gate.url + CHAT, json=chat(model="alpha"))
    assert small.status_code == 200
    assert parsed  # a small body is read on the loop: a parse costs less than a trip
    parsed.clear()
    # Many small messages: about 14 ms of parsing a megabyte, on the loop, for every other
    # request to wait out (a 32 MiB body: half a second).
    many = [{"role": "user", "content": "w"} for _ in range(OFF_LOOP_BYTES // 20)]
    big = await client.post(gate.url + CHAT, json={"model": "alpha", "messages": many})
    assert big.status_code == 200
    assert parsed == []
    assert children(upstream)["alpha"].finished == 2


async def test_a_big_body_that_is_not_json_is_refused_as_a_small_one_is(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2)})
    gate = await gate_before(upstream)
    for size in (10, OFF_LOOP_BYTES + 10):
        broken = b'{"model": "alpha", "messages": [' + b" " * size
        answer = await client.post(
            gate.url + CHAT, content=broken, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400
        assert answer.json()["error"]["message"].startswith("request body is not valid JSON")
    assert children(upstream)["alpha"].started == 0


@pytest.mark.parametrize(
    ("model", "query", "message"),
    [
        (None, "", "model name is missing from the request"),
        (7, "", "model name is missing from the request"),
        ({"id": "alpha"}, "", "model name is missing from the request"),
        ("", "", "model name is missing from the request"),
        ('al"pha\n', "", "model 'al\"pha\n' not found"),
        ("beta", "?autoload=false", "model is not loaded"),
    ],
)
async def test_every_model_refusal_on_messages_is_in_anthropics_shape(
    router: MakeRouter,
    gate_before: GatesFor,
    client: httpx.AsyncClient,
    model: Any,
    query: str,
    message: str,
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(2, "unloaded")})
    gate = await gate_before(upstream)
    body: dict[str, Any] = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    if model is not None:
        body["model"] = model
    answer = await client.post(gate.url + "/v1/messages" + query, json=body)
    assert answer.status_code == 400
    refusal = answer.json()
    assert refusal["type"] == "error"
    assert refusal["error"]["type"] == "invalid_request_error"
    assert refusal["error"]["message"] == message
    assert upstream.routing is not None
    assert upstream.routing.forwarded == [] or all(
        p == "/props" for p, _ in upstream.routing.forwarded
    )


@pytest.mark.parametrize(
    "query",
    ["?model=", "?model=%0A%22", "?model=" + "m" * 4000, "?model=%FF%FE", "?model=alpha&model=x"],
)
async def test_a_get_with_an_odd_model_is_passed_to_the_router_for_its_own_answer(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient, query: str
) -> None:
    upstream = await router({"alpha": hosted(2)})
    gate = await gate_before(upstream)
    answer = await client.get(gate.url + "/props" + query)
    # The router's own: its props, or its refusal (llama-server's `code` is the status).
    assert answer.status_code in (200, 400)
    if answer.status_code == 400:
        assert answer.json()["error"]["code"] == 400


async def test_a_transcription_goes_to_the_line_of_its_forms_model(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(2)})
    gate = await gate_before(upstream)
    files = {"file": ("a.wav", b"RIFF....", "audio/wav")}
    url = gate.url + "/v1/audio/transcriptions"
    # The router reads a form's fields as it reads a JSON body's: `model` picks the child.
    answer = await client.post(url, data={"model": "beta"}, files=files)
    assert answer.status_code == 200
    assert children(upstream)["beta"].finished == 1
    unknown = await client.post(url, data={"model": "gamma"}, files=files)
    assert unknown.status_code == 400
    assert unknown.json()["error"]["message"] == "model 'gamma' not found"
    missing = await client.post(url, files=files)
    assert missing.json()["error"]["message"] == "model name is missing from the request"
