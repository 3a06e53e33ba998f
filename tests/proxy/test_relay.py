"""The gate end to end over real sockets, in front of the stand-in llama-server."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
from typing import Any

import httpx
import openai
import pytest
from slotgate.proxy.watch import Watch
from slotgate.upstreams.cors import MAX_ORIGINS

from tests.conftest import (
    CHAT,
    GateFactory,
    RunningGate,
    chat,
    error_answered,
    hold_stream_of,
    occupy,
)
from tests.support.standin import StandIn


async def admission(client: httpx.AsyncClient, gate: RunningGate) -> dict[str, Any]:
    response = await client.get(gate.url + "/admission")
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.usefixtures("quiet_upstreams")
async def test_non_streamed_reply_is_assembled_from_a_stream_into_llama_servers_own_answer(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 200
    assert response.headers["x-request-id"]
    # llama-server was asked for a stream, with usage, so that it notices a client leaving...
    sent = json.loads(standin.seen[-1].body)
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    # ...and the client still gets exactly the answer llama-server gives a non-streamed request.
    direct = await client.post(standin.url + CHAT, json=chat())
    assert response.json() == direct.json()


async def test_every_answer_carries_the_request_id_under_both_names_sdks_read(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots = 1
    gate = await start_gate(max_queue=1)
    messages = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    answers = [
        await client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": "req-7"}),
        await client.post(gate.url + "/v1/messages", json=messages),
        await client.post(gate.url + CHAT, json=chat(stream=True)),
        await client.post(gate.url + "/v1/messages", content=b"{not json"),
        await client.post(gate.url + "/v1/embeddings", json={"input": "hi"}),
    ]
    assert answers[0].headers["request-id"] == "req-7"
    assert [a.status_code for a in answers] == [200, 200, 200, 400, 200]
    for answer in answers:
        assert answer.headers["request-id"] == answer.headers["x-request-id"]


async def test_with_stream_upstream_off_the_request_goes_upstream_as_sent(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(stream_upstream=False)
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 200
    assert json.loads(standin.seen[-1].body) == chat()
    assert response.json()["choices"][0]["message"]["content"] == "t0 t1 t2 t3 t4 "


async def test_stream_is_relayed_as_it_is_produced(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 4, 0.3
    gate = await start_gate()
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        chunks = response.aiter_raw()
        first = await anext(chunks)
        # The first token reached the client while the stand-in is still generating.
        assert b"t0" in first
        assert standin.running == 1
        standin.hurry()
        rest = b"".join([chunk async for chunk in chunks])
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_full_line_gets_429_with_retry_headers_and_a_snapshot(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(max_queue=1)
    holder = await occupy(client, gate)
    waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) >= 1
    assert int(response.headers["retry-after-ms"]) >= 1000
    assert response.headers["x-should-retry"] == "true"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert error["code"] == "queue_full"
    assert error["param"] is None
    assert error["message"].startswith(
        "llama-server generation queue is full (active=1, queued=1, capacity=1)"
    )
    snapshot = error["admission"]
    assert snapshot == {
        "capacity": 1, "active": 1, "queued": 1, "free": 0, "queue_limit": 1,
        "retry_after_s": snapshot["retry_after_s"],
    }  # fmt: skip
    assert snapshot["retry_after_s"] * 1000 == pytest.approx(
        int(response.headers["retry-after-ms"]), abs=1
    )
    standin.hurry()
    await holder
    assert (await waiter).status_code == 200


@pytest.mark.parametrize(
    ("tokens_predicted", "speed"), [((0, 0.0), 10.0), ((600, 12.0), 50.0)], ids=["new", "warm"]
)
async def test_a_cold_gate_bases_retry_after_on_max_tokens_and_llama_servers_speed(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    tokens_predicted: tuple[int, float],
    speed: float,
) -> None:
    # A llama-server that has generated nothing yet gets the cold 10 tokens/s; one that has
    # counts its own speed in /metrics.
    standin.tokens, standin.token_delay_s = 20, 0.05
    standin.total_slots = 1
    standin.tokens_predicted = tokens_predicted
    gate = await start_gate(max_queue=1)
    body = chat(stream=True, max_tokens=30)
    started = asyncio.Event()
    holder = asyncio.create_task(hold_stream_of(client, gate, body, started))
    await started.wait()
    waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat(max_tokens=30)))
    await gate.until(lambda: gate.service.admission.queued == 1)
    refused = await client.post(gate.url + CHAT, json=chat(max_tokens=30))
    assert refused.status_code == 429
    # Each holds a second for its prompt and 30 tokens / speed. The refused caller is told
    # when a place in the line frees: when the running one ends and the waiter takes its slot
    # (less what it has run already, plus a quarter to half a hold on one slot: told the very
    # moment, it would race the release it waits for).
    hold_ms = (1 + 30 / speed) * 1000
    assert hold_ms - 1000 < int(refused.headers["retry-after-ms"]) <= hold_ms * 1.5 + 1
    standin.hurry()
    await holder
    assert (await waiter).status_code == 200


async def test_no_more_generations_than_slots_ever_reach_llama_server(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 3, 0.02
    gate = await start_gate(max_queue=0)

    async def one(i: int) -> int:
        if i % 2:
            async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as r:
                body = b"".join([c async for c in r.aiter_raw()])
                assert body.endswith(b"data: [DONE]\n\n")
                return r.status_code
        return (await client.post(gate.url + CHAT, json=chat())).status_code

    statuses = await asyncio.gather(*(one(i) for i in range(30)))
    assert statuses == [200] * 30
    assert standin.started == 30
    assert standin.max_running == 2
    assert (await admission(client, gate))["active"] == 0


async def test_request_with_n_choices_takes_n_slots(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 10, 0.05
    gate = await start_gate()
    task = asyncio.create_task(client.post(gate.url + CHAT, json=chat(n=2)))
    await gate.until(lambda: standin.running == 1)
    assert gate.service.admission.active == 2
    standin.hurry()
    await task


async def test_more_choices_than_slots_is_refused_before_upstream(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    response = await client.post(gate.url + CHAT, json=chat(n=3))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n"
    assert standin.seen == []


async def test_client_that_leaves_the_line_frees_its_place_and_never_reaches_upstream(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(max_queue=1)
    holder = await occupy(client, gate)
    leaver = asyncio.create_task(client.post(gate.url + CHAT, json=chat(leaver=True)))
    await gate.until(lambda: gate.service.admission.queued == 1)
    leaver.cancel()
    await gate.until(lambda: gate.service.admission.queued == 0)
    standin.hurry()
    await holder
    await gate.until(lambda: gate.service.admission.active == 0)
    assert not any(b"leaver" in seen.body for seen in standin.seen)


async def test_client_that_leaves_mid_stream_closes_upstream_then_frees_its_slot(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(200)
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        chunks = response.aiter_raw()  # held: dropping the iterator would close the stream
        await anext(chunks)
        assert gate.service.admission.active == 1
        standin.tokens = 1  # for the waiter: the running stream already counts its 200
        waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
        await gate.until(lambda: gate.service.admission.queued == 1)
    # Leaving the block closed the client's connection mid-stream.
    await gate.until(lambda: standin.cancelled == 1)
    assert (await waiter).status_code == 200
    assert standin.max_running == 1
    await gate.until(lambda: gate.service.admission.active == 0)


async def test_capacity_follows_llama_server(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    assert (await admission(client, gate))["capacity"] == 2
    standin.total_slots = 5
    await gate.until(lambda: gate.service.admission.capacity == 5)
    snapshot = await admission(client, gate)
    assert (snapshot["capacity"], snapshot["queue_limit"]) == (5, 80)


async def test_waiting_past_queue_timeout_gets_503_queue_timeout(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(queue_timeout_s=0.2)
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "queue_timeout"
    assert "retry-after" in response.headers


async def test_waiting_stream_gets_its_head_and_keepalive_comments_then_the_stream(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(keepalive_interval_s=0.1, stream_head_after_s=0)
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        assert response.status_code == 200
        chunks = response.aiter_raw()
        first = await anext(chunks)
        assert first.startswith(b": queued position=1 eta_s=")
        body = first
        while body.count(b": queued") < 2:
            body += await anext(chunks)
        standin.hurry()
        body += b"".join([c async for c in chunks])
    assert body.endswith(b"data: [DONE]\n\n")


async def test_queue_timeout_after_the_head_went_out_is_an_in_stream_error(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(
        keepalive_interval_s=0.05, queue_timeout_s=0.2, stream_head_after_s=0
    )
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        body = b"".join([c async for c in response.aiter_raw()])
    assert response.status_code == 200
    last = body.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ")
    assert json.loads(last[len(b"data: ") :])["error"]["code"] == "queue_timeout"


async def test_a_stream_that_waits_less_than_stream_head_after_gets_llama_servers_own_answer(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(keepalive_interval_s=0.05, stream_head_after_s=30)

    async def read() -> tuple[int, bytes]:
        async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
            return response.status_code, b"".join([c async for c in response.aiter_raw()])

    waiter = asyncio.create_task(read())
    await gate.until(lambda: gate.service.admission.queued == 1)
    standin.hurry()
    status, body = await waiter
    assert status == 200
    assert b": queued" not in body
    assert body.startswith(b"data: ")
    assert body.endswith(b"data: [DONE]\n\n")


async def test_a_queue_timeout_before_the_stream_head_is_a_503_with_retry_after(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(
        keepalive_interval_s=0.05, queue_timeout_s=0.2, stream_head_after_s=30
    )
    response = await client.post(gate.url + CHAT, json=chat(stream=True))
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-should-retry"] == "true"
    assert int(response.headers["retry-after-ms"]) >= 1000
    assert response.json()["error"]["code"] == "queue_timeout"


async def test_a_stream_that_waits_past_stream_head_after_gets_the_head_and_keepalives(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(keepalive_interval_s=0.05, stream_head_after_s=0.2)
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        assert response.status_code == 200
        assert gate.service.admission.queued == 1  # the head is slotgate's: the stream still waits
        standin.hurry()
        body = b"".join([c async for c in response.aiter_raw()])
    assert body.startswith(b": queued position=1 eta_s=")
    assert body.endswith(b"data: [DONE]\n\n")


async def test_upstream_error_keeps_its_status_and_body(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.fault = "error_400"
    gate = await start_gate()
    error = await error_answered(client, gate, 400, stream=True)
    assert error["type"] == "exceed_context_size_error"


async def test_upstream_dying_mid_stream_ends_the_stream_with_an_error_event(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.fault = "die_midstream"
    gate = await start_gate()
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        body = b"".join([c async for c in response.aiter_raw()])
    assert b"t1" in body
    assert b"[DONE]" not in body
    last = body.strip().split(b"\n\n")[-1]
    assert json.loads(last[len(b"data: ") :])["error"]["code"] == "upstream_failed"
    await gate.until(lambda: gate.service.admission.active == 0)


async def test_silent_upstream_is_cut_after_the_stall_timeout_and_frees_the_slot(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.fault = "hang"
    gate = await start_gate(upstream_stall_timeout_s=0.3)
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 502
    assert "UPSTREAM_STALL_TIMEOUT_S" in response.json()["error"]["message"]
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as streamed:
        body = b"".join([c async for c in streamed.aiter_raw()])
    assert b'"upstream_failed"' in body
    await gate.until(lambda: gate.service.admission.active == 0)


async def test_refused_connection_answers_503_and_marks_not_ready(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(startup_wait_s=0)
    await standin.stop()
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    await gate.until(lambda: not gate.service.upstream.ready)
    assert (await client.get(gate.url + "/readyz")).json()["status"] == "not ready"
    assert gate.service.admission.active == 0


async def test_anthropic_messages_are_refused_in_anthropics_shape(
    loading_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await loading_gate(startup_wait_s=0)
    response = await client.post(
        gate.url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": []}
    )
    assert response.status_code == 503
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"{not json", {}, 400),
        (b"[1, 2]", {}, 400),
        (b'{"messages": [], "stream": "yes"}', {}, 400),
        (b'{"messages": [], "max_tokens": -5}', {}, 400),
        (b'{"messages": [], "n": 0}', {}, 400),
        (b'{"messages": [], "n": 1.5}', {}, 400),
        (b'{"a": "\xff\xfe"}', {}, 400),
        (b"[" * 100_000 + b"]" * 100_000, {}, 400),
        (b"<xml/>", {"content-type": "application/xml"}, 415),
        (b"", {}, 400),
    ],
)
async def test_bad_bodies_get_a_clear_4xx_and_never_reach_upstream(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    body: bytes,
    headers: dict[str, str],
    status: int,
) -> None:
    gate = await start_gate()
    response = await client.post(gate.url + CHAT, content=body, headers=headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert standin.seen == []
    assert gate.service.admission.active == 0


async def test_body_over_the_limit_gets_413_before_any_slot_is_taken(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(max_body_bytes=1000)
    response = await client.post(gate.url + CHAT, json=chat(padding="x" * 2000))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"
    assert standin.seen == []


async def test_a_chunked_body_over_the_limit_gets_413_even_when_it_arrives_in_one_piece(
    start_gate: GateFactory, standin: StandIn
) -> None:
    gate = await start_gate(max_body_bytes=1000)
    body = json.dumps(chat(padding="x" * 2000)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
        % (CHAT.encode(), len(body), body)
    )
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status_line.startswith(b"HTTP/1.1 413 ")
    assert standin.seen == []


async def test_admission_control_off_passes_everything_straight_through(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 5, 0.05
    gate = await start_gate(admission_control=False)
    statuses = await asyncio.gather(*(client.post(gate.url + CHAT, json=chat()) for _ in range(5)))
    assert [r.status_code for r in statuses] == [200] * 5
    assert standin.max_running > 2  # nothing held them back


async def test_with_admission_control_off_a_client_that_leaves_still_closes_upstream(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 200, 0.05
    gate = await start_gate(admission_control=False)
    async with client.stream("POST", gate.url + CHAT, json=chat(stream=True)) as response:
        chunks = response.aiter_raw()
        await anext(chunks)
    await gate.until(lambda: standin.cancelled == 1)
    assert standin.running == 0


async def test_with_keepalive_off_a_waiting_stream_keeps_exact_status_codes(
    one_slot_held: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held(keepalive_interval_s=0, queue_timeout_s=0.2)
    response = await client.post(gate.url + CHAT, json=chat(stream=True))
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "queue_timeout"


async def test_request_with_n_cmpl_takes_n_cmpl_slots_whatever_n_says(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.tokens, standin.token_delay_s = 10, 0.05
    gate = await start_gate()
    task = asyncio.create_task(client.post(gate.url + CHAT, json=chat(n_cmpl=2, n=1)))
    await gate.until(lambda: standin.running == 1)
    assert gate.service.admission.active == 2
    second = asyncio.create_task(client.post(gate.url + CHAT, json=chat(n_cmpl=2)))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert standin.started == 1
    standin.hurry()
    assert (await task).status_code == 200
    assert (await second).status_code == 200
    assert standin.max_running == 1


async def test_transcription_without_v1_waits_for_a_slot_like_any_generation(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot()
    holder = await occupy(client, gate)
    files = {"file": ("a.wav", b"RIFF....", "audio/wav")}
    waiter = asyncio.create_task(client.post(gate.url + "/audio/transcriptions", files=files))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert [seen.path for seen in standin.seen] == [CHAT]
    standin.hurry()
    await holder
    assert (await waiter).status_code == 200
    assert standin.seen[-1].path == "/audio/transcriptions"


async def test_json_nested_past_the_limit_is_a_400_in_the_apis_shape_never_a_500(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    # Deeper than orjson writes (254), shallower than it reads (1024): once passed through and
    # then failed when slotgate rewrote the body as a stream request.
    nested = b'{"messages": [], "x": ' + b"[" * 300 + b"]" * 300 + b"}"
    for path, shape in ((CHAT, "openai"), ("/v1/messages", "anthropic")):
        response = await client.post(
            gate.url + path, content=nested, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        body = response.json()
        assert "deeper than 254 levels" in body["error"]["message"]
        assert (body.get("type") == "error") is (shape == "anthropic")
    assert standin.seen == []


@pytest.mark.parametrize(
    "request_bytes",
    [
        # A declared body that never comes: the client closes after the head...
        b"POST /slots/0?action=erase HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
        # ...or after part of it.
        b'POST /slots/0?action=erase HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"a"',
        b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"a"',
        # Chunked framing that is not chunked framing.
        b"POST /slots/0?action=erase HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n",
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\nzz\r\n",
    ],
)
async def test_a_request_whose_body_never_arrives_whole_is_never_forwarded(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, request_bytes: bytes
) -> None:
    gate = await start_gate()
    _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(request_bytes)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.3)  # time for a request that was let through to reach the stand-in
    assert (await client.post(gate.url + "/tokenize", json={"content": "x"})).status_code == 200
    assert [seen.path for seen in standin.seen] == ["/tokenize"]
    assert gate.service.admission.active == 0


async def test_keyless_requests_from_made_up_origins_neither_teach_nor_flush_cors(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="k1")
    cors = gate.service.upstream.cors
    app = {"Origin": "http://app.example", "Authorization": "Bearer k1"}
    assert (await client.post(gate.url + CHAT, json=chat(), headers=app)).status_code == 200
    # At once: none of them teaches, whatever the order they come in.
    answers = await asyncio.gather(
        *(
            client.get(gate.url + "/health", headers={"Origin": f"http://{i}.example"})
            for i in range(MAX_ORIGINS + 10)
        )
    )
    assert {a.status_code for a in answers} == {200}
    assert cors.headers_for(b"http://app.example")[0] == (
        b"access-control-allow-origin",
        b"http://app.example",
    )
    assert cors.headers_for(b"http://0.example") == [(b"vary", b"Origin")]


async def test_without_keys_only_answers_on_generation_routes_teach_cors(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    cors = gate.service.upstream.cors
    await client.get(gate.url + "/health", headers={"Origin": "http://health.example"})
    await client.post(gate.url + "/tokenize", json={}, headers={"Origin": "http://tok.example"})
    await client.post(gate.url + CHAT, json=chat(), headers={"Origin": "http://app.example"})
    assert cors.headers_for(b"http://health.example") == [(b"vary", b"Origin")]
    assert cors.headers_for(b"http://tok.example") == [(b"vary", b"Origin")]
    assert (b"access-control-allow-origin", b"http://app.example") in cors.headers_for(
        b"http://app.example"
    )


async def test_bodies_held_in_line_are_bounded_and_released_when_their_requests_leave_it(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(queue_body_bytes=1000, max_queue=0)
    holder = await occupy(client, gate)
    big = chat(padding="x" * 500)
    first = asyncio.create_task(client.post(gate.url + CHAT, json=big))
    await gate.until(lambda: gate.service.admission.queued == 1)
    # A second body that big would put more than 1000 bytes in the line: 429, with a snapshot.
    refused = await client.post(gate.url + CHAT, json=big)
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "queue_bytes_full"
    assert error["type"] == "rate_limit_error"
    assert "QUEUE_BODY_BYTES (1000)" in error["message"]
    assert error["admission"]["queued"] == 1
    assert gate.service.admission.queued == 1  # the refused request left no place behind
    # A small one still fits beside it.
    small = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 2)
    standin.hurry()
    await holder
    assert (await first).status_code == 200
    assert (await small).status_code == 200
    # Both left the line: their bytes no longer count, and a big body may wait again.
    standin.token_delay_s = 0.05
    holder = await occupy(client, gate)
    again = asyncio.create_task(client.post(gate.url + CHAT, json=big))
    await gate.until(lambda: gate.service.admission.queued == 1)
    leaver = asyncio.create_task(client.post(gate.url + CHAT, json=chat(padding="y" * 200)))
    await gate.until(lambda: gate.service.admission.queued == 2)
    leaver.cancel()
    await gate.until(lambda: gate.service.admission.queued == 1)
    # The one that left while waiting gave its bytes back too.
    late = asyncio.create_task(client.post(gate.url + CHAT, json=chat(padding="z" * 200)))
    await gate.until(lambda: gate.service.admission.queued == 2)
    standin.hurry()
    await holder
    assert [(await t).status_code for t in (again, late)] == [200, 200]


@pytest.mark.parametrize("head_after_s", [0, 30], ids=["head-at-once", "head-later"])
async def test_the_openai_sdk_retries_a_timed_out_stream_only_when_its_head_was_not_sent(
    start_gate: GateFactory, standin: StandIn, head_after_s: float
) -> None:
    # 6 streams on 2 slots that each hold 0.5 s: the last two in line wait 1 s, past the
    # 0.7 s queue timeout, however fast the machine is.
    standin.tokens, standin.token_delay_s = 10, 0.05
    gate = await start_gate(keepalive_interval_s=0.1, queue_timeout_s=0.7,
                            stream_head_after_s=head_after_s)  # fmt: skip
    sdk = openai.AsyncOpenAI(base_url=gate.url + "/v1", api_key="unused", timeout=30)

    async def call() -> str:
        try:
            stream = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for _ in stream:
                pass
        except openai.APIStatusError as exc:
            return f"status {exc.status_code}"
        except openai.APIError:
            return "in-stream error"
        return "ok"

    async with sdk:
        outcomes = await asyncio.gather(*(call() for _ in range(6)))
    timed_out = gate.service.metrics._rejected.get((CHAT, "queue_timeout"), 0)
    assert timed_out >= 2
    if head_after_s:
        # Each timeout was a 503 with Retry-After, and the SDK's own retries came back for it.
        assert "in-stream error" not in outcomes
        assert outcomes.count("ok") > 6 - timed_out
    else:
        assert outcomes.count("in-stream error") == timed_out


async def test_a_slow_reader_pushes_back_on_upstream_instead_of_filling_memory(
    start_gate: GateFactory, standin: StandIn
) -> None:
    # 64 MiB of stream, produced as fast as the sockets take it.
    standin.tokens, standin.token_delay_s, standin.padding = 16_000, 0, 4096
    total = standin.tokens * (4096 + 100)
    gate = await start_gate()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", gate.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = b'{"messages":[],"stream":true}'
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip
    await writer.drain()
    await reader.read(1024)
    # The client stops reading. Once the socket buffers along the way are full, the stand-in
    # pushes nothing for half a second (however long a loaded machine takes to fill them)...
    loop = asyncio.get_running_loop()
    stalled_at, still_since = standin.sent_bytes, loop.time()
    async with asyncio.timeout(20):
        while loop.time() - still_since < 0.5:
            await asyncio.sleep(0.05)
            if standin.sent_bytes != stalled_at:
                stalled_at, still_since = standin.sent_bytes, loop.time()
    # ...having pushed no more than those buffers hold: the relay waits for the client instead
    # of reading ahead into memory.
    assert stalled_at < total / 4
    received = 0
    async with asyncio.timeout(60):
        while chunk := await reader.read(1 << 20):
            received += len(chunk)
            if chunk.endswith(b"0\r\n\r\n"):
                break
    assert standin.sent_bytes > total * 0.99
    writer.close()
    await gate.until(lambda: gate.service.admission.active == 0)


async def test_a_finished_request_leaves_no_reference_cycle_for_the_collector(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    # A cycle through a request's watch kept it, its task, coroutine and context alive until a
    # garbage collection: one for every request, which made collections a quarter of the cost
    # at 32 connections. Freed by reference count, nothing of it reaches the collector.
    gate = await start_gate()
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
        gc.collect()
        left = [type(thing).__name__ for thing in gc.garbage if isinstance(thing, Watch)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
