"""What operators and clients read off every answer: request ids, retry hints, and rejection
series for every reason a refusal can carry."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from slotgate.errors import (
    ANSWERS,
    refusal,
)
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.intake.pace import generation_speed
from slotgate.metrics import REASONS
from slotgate.proxy.refusals import retry_headers

from tests.conftest import CHAT, GateFactory, chat
from tests.support.standin import StandIn
from tests.support.tools import tool


def test_every_reason_a_refusal_can_carry_has_a_series_from_the_start() -> None:
    reasons = {shape.reason for shape in ANSWERS.values()}
    reasons |= {"client_gone", refusal(RuntimeError()).reason}
    assert reasons <= set(REASONS)


@pytest.mark.parametrize("seconds", [1.0, 1.2, 1.5, 1.501, 2.49, 2.5, 7.7, 59.999, 60.0])
def test_retry_after_and_retry_after_ms_agree_within_half_a_second(seconds: float) -> None:
    headers = dict(retry_headers(seconds))
    whole = int(headers[b"retry-after"])
    ms = int(headers[b"retry-after-ms"])
    assert abs(whole - ms / 1000) <= 0.5
    assert whole == max(1, math.floor(ms / 1000 + 0.5))


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/healthz", 200),
        ("GET", "/readyz", 200),
        ("GET", "/admission", 200),
        ("GET", "/metrics?source=slotgate", 200),
        ("GET", "/metrics?source=nonsense", 400),
        ("POST", "/healthz", 405),
    ],
)
async def test_slotgates_own_routes_answer_with_the_request_id(
    start_gate: GateFactory, client: httpx.AsyncClient, method: str, path: str, status: int
) -> None:
    gate = await start_gate()
    answer = await client.request(method, gate.url + path)
    assert answer.status_code == status
    assert answer.headers["request-id"]
    assert answer.headers["request-id"] == answer.headers["x-request-id"]
    mine = await client.request(method, gate.url + path, headers={"x-request-id": "req-9"})
    assert mine.headers["request-id"] == "req-9"


async def test_a_refused_key_on_slotgates_own_routes_carries_the_request_id(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="sekrit")
    answer = await client.get(gate.url + "/admission")
    assert answer.status_code == 401
    assert answer.headers["request-id"] == answer.headers["x-request-id"]


async def test_a_not_ready_answer_of_readyz_carries_the_request_id(
    loading_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await loading_gate()
    answer = await client.get(gate.url + "/readyz")
    assert answer.status_code == 503
    assert answer.headers["request-id"]


async def _raw_answer(port: int, request_bytes: bytes) -> tuple[bytes, dict[str, str]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes)
    try:
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert json.loads(body)["error"]
    return lines[0].encode(), headers


async def test_an_upgrade_refused_by_the_protocol_carries_the_clients_request_id(
    start_gate: GateFactory,
) -> None:
    gate = await start_gate()
    status, headers = await _raw_answer(
        gate.port,
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Request-Id: req-5\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\n\r\n",
    )
    assert status == b"HTTP/1.1 400 Bad Request"
    assert headers["request-id"] == headers["x-request-id"] == "req-5"


async def test_bytes_that_are_not_http_get_a_400_with_a_request_id(
    start_gate: GateFactory,
) -> None:
    gate = await start_gate()
    status, headers = await _raw_answer(gate.port, b"\x16\x03\x01")
    assert status == b"HTTP/1.1 400 Bad Request"
    assert headers["request-id"] == headers["x-request-id"]
    assert headers["request-id"]


async def test_a_head_timeout_answer_carries_a_request_id(start_gate: GateFactory) -> None:
    gate = await start_gate(head_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Slow: a")
    try:
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"\r\nrequest-id: " in answer.partition(b"\r\n\r\n")[0]


async def test_shutdown_while_a_stream_waits_for_its_head_is_a_503_with_retry_after(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(keepalive_interval_s=0.05, stream_head_after_s=30)
    waiting = asyncio.create_task(client.post(gate.url + CHAT, json=chat(stream=True)))
    await gate.until(lambda: gate.service.admission.queued == 1)
    gate.service.drain()
    response = await waiting
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "shutting_down"
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["request-id"]


async def test_slotgates_series_over_http_pass_promtool_after_refusals_with_a_budget(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(kv_budget_tokens=1000)
    assert (await client.post(gate.url + CHAT, content=b"{")).status_code == 400
    answer = await client.get(gate.url + "/metrics?source=slotgate")
    assert 'slotgate_requests_rejected_total{family="chat",reason="bad_request"} 1.0' in answer.text
    promtool = tool("promtool", "prometheus")
    checker = await asyncio.create_subprocess_exec(
        promtool, "check", "metrics", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    said, _ = await checker.communicate(answer.content)
    assert checker.returncode == 0, said


@pytest.mark.parametrize(
    ("tokens", "seconds"), [("nan", "2"), ("10", "NaN"), ("+Inf", "2"), ("10", "+Inf")]
)
def test_a_generation_speed_that_is_not_a_finite_number_is_not_learned(
    tokens: str, seconds: str
) -> None:
    metrics = (
        f"llamacpp:tokens_predicted_total {tokens}\n"
        f"llamacpp:tokens_predicted_seconds_total {seconds}\n"
    ).encode()
    assert generation_speed(metrics) is None


@pytest.mark.parametrize("hold_s", [math.nan, math.inf, -1.0])
def test_an_expected_hold_that_is_not_a_time_leaves_retry_after_a_number(hold_s: float) -> None:
    admission = Admission(QueuePolicy(), capacity=1)
    admission.expect(hold_s)
    retry_after_s = admission.retry_after_s(3)
    assert math.isfinite(retry_after_s)
    assert retry_headers(retry_after_s)
