"""slotgate's own routes: health, readiness, the pool snapshot, metrics and the access log."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from slotgate.logs import JsonFormatter

from tests.conftest import GateFactory, assert_lines, chat
from tests.support.standin import StandIn


async def test_healthz_answers_even_without_llama_server(
    loading_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await loading_gate()
    assert (await client.get(gate.url + "/healthz")).json() == {"status": "ok"}
    readyz = await client.get(gate.url + "/readyz")
    assert readyz.status_code == 503
    assert "Loading model" in readyz.json()["reason"]
    # llama-server's own /health still passes through.
    assert (await client.get(gate.url + "/health")).status_code == 503


async def test_own_routes_answer_head_probes_and_refuse_other_methods_in_the_api_shape(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    for path in ("/healthz", "/readyz"):
        assert (await client.head(gate.url + path)).status_code == 200, path
    refused = await client.post(gate.url + "/healthz")
    assert refused.status_code == 405
    assert "GET" in refused.headers["allow"]
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "method_not_allowed"


async def test_a_llama_server_that_wants_a_key_is_named_in_readyz_until_slotgate_has_it(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.api_key = "secret"
    gate = await start_gate(ready=False)
    readyz = await client.get(gate.url + "/readyz")
    assert readyz.status_code == 503
    assert "set LLAMA_API_KEY" in readyz.json()["reason"]
    keyed = await start_gate(llama_api_key="secret")
    assert (await client.get(keyed.url + "/readyz")).status_code == 200


async def test_admission_shows_the_live_pool(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(max_queue=3)
    tasks = [
        asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat()))
        for _ in range(2)
    ]
    await gate.until(lambda: gate.service.admission.queued == 1)
    snapshot = (await client.get(gate.url + "/admission")).json()
    assert {k: snapshot[k] for k in ("capacity", "active", "queued", "free", "queue_limit")} == {
        "capacity": 1, "active": 1, "queued": 1, "free": 0, "queue_limit": 3,
    }  # fmt: skip
    assert snapshot["upstream"]["url"] == standin.url
    assert snapshot["upstream"]["ready"] is True
    assert snapshot["upstream"]["n_ctx"] == 1024
    assert snapshot["upstream"]["model"] == "standin.gguf"
    standin.hurry()
    await asyncio.gather(*tasks)


async def test_unbounded_line_shows_a_null_limit(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(max_queue=0)
    assert (await client.get(gate.url + "/admission")).json()["queue_limit"] is None


async def test_metrics_show_both_sides_of_the_gate(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    # A generation of 20 s, cut short by `hurry` once the metrics are read: the first request
    # must still be running then, however slowly a busy machine gets there.
    gate = await one_slot(400, max_queue=1)
    first = asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat()))
    await gate.until(lambda: gate.service.admission.active == 1)
    second = asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    refused = await client.post(gate.url + "/v1/chat/completions", json=chat())
    assert refused.status_code == 429
    mid = (await client.get(gate.url + "/metrics")).text
    assert_lines(
        mid,
        "slotgate_slots_capacity 1.0",
        "slotgate_slots_active 1.0",
        "slotgate_queue_depth 1.0",
        "slotgate_queue_limit 1.0",
        "slotgate_upstream_ready 1.0",
        'slotgate_requests_rejected_total{family="chat",reason="queue_full"} 1.0',
        "llamacpp:requests_processing 1",
    )
    standin.hurry()
    await asyncio.gather(first, second)
    bad = await client.post(gate.url + "/v1/chat/completions", content=b"{")
    assert bad.status_code == 400
    after = (await client.get(gate.url + "/metrics")).text
    assert_lines(
        after,
        'slotgate_requests_admitted_total{family="chat"} 2.0',
        'slotgate_requests_rejected_total{family="chat",reason="bad_request"} 1.0',
        'slotgate_queue_wait_seconds_count{family="chat",outcome="admitted"} 2.0',
        'slotgate_slot_hold_seconds_count{family="chat"} 2.0',
    )


async def test_every_request_gets_one_structured_log_line(
    start_gate: GateFactory, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    gate = await start_gate()
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        response = await client.post(
            gate.url + "/v1/chat/completions", json=chat(), headers={"X-Request-Id": "req-42"}
        )
    assert response.headers["x-request-id"] == "req-42"
    records = [r for r in caplog.records if r.name == "slotgate.access"]
    assert len(records) == 1
    line = json.loads(JsonFormatter().format(records[0]))
    assert line["request_id"] == "req-42"
    assert line["route"] == "/v1/chat/completions"
    assert line["outcome"] == "served"
    assert line["status"] == line["upstream_status"] == 200
    assert line["queue_wait_s"] >= 0
    assert line["slot_hold_s"] > 0
    assert line["bytes_out"] == len(response.content)


async def test_api_keys_never_appear_in_logs(
    start_gate: GateFactory, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    gate = await start_gate(api_keys="sekrit-key", llama_api_key="upstream-sekrit")
    with caplog.at_level(logging.DEBUG):
        await client.post(
            gate.url + "/v1/chat/completions", json=chat(), headers={"X-Api-Key": "sekrit-key"}
        )
        await client.get(gate.url + "/admission", headers={"X-Api-Key": "wrong-sekrit"})
    text = "\n".join(JsonFormatter().format(r) for r in caplog.records)
    assert "sekrit" not in text
    assert "slotgate.access" in text
