"""What llama-server says survives slotgate: its headers where slotgate merges or assembles,
and a bound on what an assembled answer may hold."""

from __future__ import annotations

import httpx
import pytest
import slotgate.relay

from tests.conftest import GateFactory, chat
from tests.standin import StandIn

CHAT = "/v1/chat/completions"


async def test_merged_metrics_keep_llama_servers_process_start_time_header(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    response = await client.get(gate.url + "/metrics")
    assert response.status_code == 200
    assert "llamacpp:requests_processing" in response.text
    assert response.headers["process-start-time-unix"] == str(standin.created)


async def test_an_assembled_answer_keeps_llama_servers_own_headers(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    origin = {"Origin": "http://app.example"}
    response = await client.post(gate.url + CHAT, json=chat(), headers=origin)
    assert response.status_code == 200
    assert b'"stream":true' in standin.seen[-1].body  # asked upstream as a stream
    assert response.headers["access-control-allow-origin"] == "http://app.example"
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    assert "x-accel-buffering" not in response.headers
    assert response.json()["usage"]["completion_tokens"] == standin.tokens


async def test_an_assembled_answer_past_its_bound_is_cut_with_a_502_in_the_api_shape(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slotgate.relay, "MAX_ASSEMBLED_BYTES", 64 * 1024)
    standin.tokens, standin.token_delay_s, standin.padding = 500, 0.0, 1024
    gate = await start_gate()
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed"
    assert "stream" in error["message"]
    await gate.until(lambda: gate.service.admission.active == 0)


async def test_once_llama_server_shows_verbose_non_streamed_requests_go_as_sent(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.verbose = True
    gate = await start_gate()
    first = await client.post(gate.url + CHAT, json=chat())
    assert first.status_code == 200
    assert b'"stream":true' in standin.seen[-1].body  # assembled: the stream showed __verbose
    second = await client.post(gate.url + CHAT, json=chat())
    assert second.status_code == 200
    assert b'"stream":true' not in standin.seen[-1].body  # as sent
    assert second.json()["__verbose"] == {"stream": False}  # llama-server's own answer
