"""Waiting while llama-server starts, on real sockets: a request that waits holds a place, body
bytes and KV-cache tokens at once, and every way out gives all three back."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from slotgate.errors import BadRequest
from slotgate.intake.body import take_off_loop
from slotgate.intake.endpoints import ENDPOINTS, Demand, demand

from tests.conftest import CHAT, GateFactory, RunningGate, chat
from tests.support.hostile import (
    CHAT_STREAM,
    PARTIAL_EVENT,
    SSE_HEAD,
    Hostile,
    MiB,
    Peer,
    Request,
    event,
    huge_error,
    huge_head,
    reply,
    sends,
    stream,
)
from tests.support.standin import StandIn
from tests.support.startup import BIG, big_chat, restarting_gate, settled


async def one_waiting(gate: RunningGate, client: httpx.AsyncClient) -> asyncio.Task[httpx.Response]:
    """A big chat, once it waits in line holding its body and its tokens."""
    asked = asyncio.create_task(client.post(gate.url + CHAT, json=big_chat()))
    await waiting(gate)
    return asked


async def waiting(gate: RunningGate, count: int = 1) -> None:
    """Until `count` requests wait in line, each holding its body and its tokens."""
    await gate.until(
        lambda: (
            gate.service.admission.queued == count
            and sum(1 for t in gate.service.admission._line.tickets() if t.cost) == count
        )
    )
    assert gate.service.proxy.body_bytes.held > BIG * count


async def test_a_client_that_leaves_while_llama_server_loads_gives_back_place_bytes_and_tokens(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await restarting_gate(start_gate, standin)
    asked = await one_waiting(gate, client)
    asked.cancel()
    await gate.until(lambda: settled(gate))
    standin.loading = False
    await gate.until(lambda: gate.service.admission.capacity == 2)
    assert [seen for seen in standin.seen if seen.path == CHAT] == []


async def test_a_startup_wait_that_runs_out_gives_back_place_bytes_and_tokens(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await restarting_gate(start_gate, standin, startup_wait_s=0.5)
    answers = await asyncio.gather(
        client.post(gate.url + CHAT, json=big_chat()),
        client.post(gate.url + CHAT, json=big_chat(stream=True)),
    )
    assert [a.status_code for a in answers] == [503, 503]
    assert {a.json()["error"]["code"] for a in answers} == {"upstream_not_ready"}
    assert settled(gate)


async def test_a_queue_timeout_shorter_than_the_startup_wait_gives_back_everything(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await restarting_gate(start_gate, standin, queue_timeout_s=0.4, startup_wait_s=30)
    answer = await client.post(gate.url + CHAT, json=big_chat())
    assert answer.status_code == 503
    assert settled(gate)


async def test_a_request_refused_once_the_slot_count_is_known_gives_back_everything(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await restarting_gate(start_gate, standin)
    too_many = asyncio.create_task(client.post(gate.url + CHAT, json=big_chat(n=3)))
    too_many_cmpl = asyncio.create_task(
        client.post(gate.url + "/completion", json={"prompt": "x" * BIG, "n_cmpl": 3})
    )
    fits = asyncio.create_task(client.post(gate.url + CHAT, json=big_chat(n=2)))
    await waiting(gate, 3)
    standin.loading = False
    refused, refused_cmpl, served = await asyncio.gather(too_many, too_many_cmpl, fits)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "n")
    assert (refused_cmpl.status_code, refused_cmpl.json()["error"]["param"]) == (400, "n_cmpl")
    assert served.status_code == 200
    assert standin.max_running <= 2
    await gate.until(lambda: settled(gate))


async def test_a_body_past_the_line_s_byte_bound_while_llama_server_loads_is_refused_429(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await restarting_gate(start_gate, standin, queue_body_bytes=BIG + BIG // 2)
    first = await one_waiting(gate, client)
    second = await client.post(gate.url + CHAT, json=big_chat())
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "queue_bytes_full"
    assert "retry-after" in second.headers
    standin.loading = False
    assert (await first).status_code == 200
    await gate.until(lambda: settled(gate))


async def test_shutdown_while_llama_server_loads_answers_waiters_and_gives_back_everything(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await restarting_gate(start_gate, standin)
    asked = await one_waiting(gate, client)
    await gate.stop()
    answer = await asked
    assert answer.status_code == 503
    assert settled(gate)


@pytest.mark.usefixtures("quiet_upstreams")
async def test_a_big_non_streamed_chat_that_waited_for_llama_server_is_assembled_whole(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await restarting_gate(start_gate, standin)
    asked = await one_waiting(gate, client)
    standin.loading = False
    answer = await asked
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "t0 t1 t2 t3 t4 "}
    assert body["usage"]["completion_tokens"] == 5
    sent = json.loads([seen for seen in standin.seen if seen.path == CHAT][-1].body)
    assert sent["stream"] is True  # rewritten in the worker, then assembled
    await gate.until(lambda: settled(gate))


def _post(path: str, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "reset"])
async def test_a_pipelined_client_that_leaves_while_llama_server_loads_leaves_no_ghost(
    start_gate: GateFactory, standin: StandIn, reset: bool
) -> None:
    gate = await restarting_gate(start_gate, standin)
    reader, writer = await asyncio.open_connection("127.0.0.1", gate.port)
    writer.write(_post(CHAT, big_chat()) + _post(CHAT, chat()))
    await writer.drain()
    await waiting(gate)
    if reset:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()
    await gate.until(lambda: settled(gate))
    standin.loading = False
    await gate.until(lambda: gate.service.admission.capacity == 2)
    await asyncio.sleep(0.3)  # room for a ghost to reach llama-server
    assert [seen for seen in standin.seen if seen.path == CHAT] == []
    del reader


async def test_requests_that_wait_for_llama_server_s_first_start_are_admitted_within_the_budget(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots, standin.loading = 4, True
    gate = await start_gate(ready=False, kv_budget_tokens=1000)
    prompt = {"role": "user", "content": "w " * 300}
    asked = [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=chat(messages=[prompt], max_tokens=80))
        )
        for _ in range(4)
    ]
    await gate.until(lambda: gate.service.admission.queued == 4)
    standin.loading = False
    answers = await asyncio.gather(*asked)
    assert [a.status_code for a in answers] == [200] * 4
    # 704 tokens each by the local bound (llama-server could not count them while it loaded):
    # one at a time in a budget of 1000, although four slots are free.
    assert standin.max_running == 1
    await gate.until(lambda: settled(gate))


# -- a hostile llama-server that starts loading, then misbehaves ---------------------------------

LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


class Starting:
    """/props as a llama-server that loads its model until `loaded` is set."""

    def __init__(self, hostile: Hostile) -> None:
        self.hostile = hostile
        self.loaded = False

    async def __call__(self, peer: Peer, request: Request) -> None:
        if self.loaded:
            await peer.write(reply(200, self.hostile._props()))
        else:
            await peer.write(reply(503, LOADING))


@pytest.fixture
async def hostile() -> AsyncIterator[Hostile]:
    upstream = Hostile(total_slots=2, fallback=stream(*CHAT_STREAM))
    await upstream.start()
    yield upstream
    await upstream.stop()


#: CHAT_STREAM as one write, chunked as llama-server frames it.
CHAT_STREAM_SENT = (
    SSE_HEAD + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in CHAT_STREAM) + b"0\r\n\r\n",
)

MISBEHAVIOURS = {
    "huge-head": huge_head(20 * MiB),
    "response-too-many": sends(CHAT_STREAM_SENT[0] + reply(200, b'{"n":"extra"}')),
    "interim-then-stream": sends(b"HTTP/1.1 100 Continue\r\n\r\n", 0.05, *CHAT_STREAM_SENT),
    "switching": sends(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nraw"),
    "cut-mid-event": stream(*CHAT_STREAM[:2], cut=PARTIAL_EVENT),
    "loading-again": sends(reply(503, LOADING)),
    "huge-error": huge_error(8 * MiB, chunked=True),
}


def answered(status: int, body: bytes, streamed: bool) -> str:
    """What the client got: "served", or the error code it was told."""
    if not streamed:
        if status == 200:
            assert json.loads(body)["choices"][0]["message"]["content"] == "one"
            return "served"
        return str(json.loads(body)["error"]["code"])
    assert status == 200
    assert b"data: data:" not in body
    last = [e for e in body.split(b"\n\n") if e and not e.startswith(b":")][-1]
    if last == b"data: [DONE]":
        return "served"
    return str(json.loads(last[len(b"data: ") :])["error"]["code"])


@pytest.mark.usefixtures("quiet_upstreams")
@pytest.mark.parametrize("streamed", [False, True], ids=["assembled", "waiting-stream"])
@pytest.mark.parametrize("misbehaviour", sorted(MISBEHAVIOURS))
async def test_a_request_that_waited_for_a_hostile_llama_server_to_start_gets_a_clear_answer(
    start_gate: GateFactory,
    hostile: Hostile,
    client: httpx.AsyncClient,
    misbehaviour: str,
    streamed: bool,
) -> None:
    starting = Starting(hostile)
    hostile.props = starting
    gate: RunningGate = await start_gate(
        llama_server_url=hostile.url, ready=False, props_refresh_interval_s=60,
        keepalive_interval_s=0.05, stream_head_after_s=0, startup_wait_s=10,
        queue_body_bytes=4 * BIG,
    )  # fmt: skip
    hostile.script.append(MISBEHAVIOURS[misbehaviour])

    async def ask() -> tuple[int, bytes]:
        payload = big_chat(stream=streamed)
        async with client.stream("POST", gate.url + CHAT, json=payload) as response:
            return response.status_code, b"".join([c async for c in response.aiter_raw()])

    asked = asyncio.create_task(ask())
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert gate.service.proxy.body_bytes.held > BIG
    starting.loaded = True
    outcome = answered(*await asked, streamed)
    served = ("loading-again", "interim-then-stream", "response-too-many")
    expected = dict.fromkeys(served, "served")
    if not streamed:
        expected["huge-error"] = "500"  # relayed as it comes, at the pace the client reads it
    assert outcome == expected.get(misbehaviour, "upstream_failed")
    await gate.until(lambda: settled(gate))
    # Nothing the misbehaviour left behind reaches the next client.
    assert answered(*await ask(), streamed) == "served"
    await gate.until(lambda: settled(gate))


@pytest.mark.interpreted
async def test_a_big_body_whose_parse_ends_after_llama_server_is_back_is_weighed_by_its_slots(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = await restarting_gate(start_gate, standin)
    parse = take_off_loop
    parsing: list[int] = []

    async def slow(*args: Any, **kwargs: Any) -> Any:
        # The worker's parse outlasts llama-server's start: the slot count is known after it.
        parsing.append(args[2].capacity)  # the capacity the request was read with: unknown
        taken = await parse(*args, **kwargs)
        await gate.until(lambda: gate.service.admission.capacity == 2)
        return taken

    monkeypatch.setattr("slotgate.proxy.relay.take_off_loop", slow)
    prompts = {"prompt": ["x" * (BIG // 3)] * 3}  # three tasks: they fill both slots
    asked = [
        asyncio.create_task(client.post(gate.url + "/completion", json=prompts)),
        asyncio.create_task(client.post(gate.url + "/completion", json=prompts | {"n": 3})),
    ]
    await gate.until(lambda: len(parsing) == 2)
    assert gate.service.admission.capacity is None
    standin.loading = False
    served, refused = await asyncio.gather(*asked)
    assert served.status_code == 200
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "n")
    assert "more choices than llama-server has slots" in refused.json()["error"]["message"]
    await gate.until(lambda: settled(gate))


NATIVE_STREAM = (
    event({"index": 0, "content": "a", "tokens": [1], "stop": False}),
    event({"index": 0, "content": "b", "tokens": [2], "stop": False}),
    event({"index": 0, "content": "", "tokens": [], "stop": True, "stop_type": "limit",
           "generation_settings": {"stream": True}, "tokens_predicted": 2}),
)  # fmt: skip


@pytest.mark.parametrize("size", [16, BIG], ids=["small", "big"])
@pytest.mark.parametrize("return_tokens", [False, True])
async def test_a_native_answer_assembled_from_a_big_body_keeps_its_tokens_as_asked(
    start_gate: GateFactory,
    hostile: Hostile,
    client: httpx.AsyncClient,
    size: int,
    return_tokens: bool,
) -> None:
    hostile.fallback = stream(*NATIVE_STREAM)
    starting = Starting(hostile)
    hostile.props = starting
    gate: RunningGate = await start_gate(
        llama_server_url=hostile.url, ready=False, props_refresh_interval_s=60
    )
    payload = {"prompt": "x" * size, "return_tokens": return_tokens}
    asked = asyncio.create_task(client.post(gate.url + "/completion", json=payload))
    await gate.until(lambda: gate.service.admission.queued == 1)  # waits for llama-server, too
    starting.loaded = True
    answer = (await asked).json()
    assert answer["content"] == "ab"
    assert answer["tokens"] == ([1, 2] if return_tokens else [])
    assert answer["generation_settings"] == {"stream": False}
    sent = json.loads(hostile.served()[-1].body)
    assert (sent["stream"], sent["return_tokens"]) == (True, return_tokens)


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        (CHAT, {"messages": [], "n": 2}),
        (CHAT, {"messages": [], "n_cmpl": 3, "n": 1}),
        (CHAT, {"messages": [], "n_cmpl": None, "n": 3}),
        ("/completion", {"prompt": ["a", "b", "c"], "n_cmpl": 2}),
        ("/completion", {"prompt": [1, 2, 3]}),
        ("/v1/embeddings", {"input": ["a", "b", "c", "d"]}),
        ("/v1/rerank", {"query": "q", "documents": ["a", "b", "c"]}),
    ],
)
@pytest.mark.parametrize("capacity", [1, 2, 4])
def test_a_demand_read_without_a_slot_count_weighs_as_one_read_with_it(
    path: str, payload: dict[str, Any], capacity: int
) -> None:
    endpoint = ENDPOINTS[path]
    body = json.dumps(payload).encode()
    unsized = demand(endpoint, body, sys.maxsize)
    weighs: list[Callable[[], Demand]] = [
        lambda: demand(endpoint, body, capacity),
        lambda: unsized.at(capacity),
    ]
    outcomes: list[object] = []
    for weigh in weighs:
        try:
            outcomes.append(weigh())
        except BadRequest as refused:
            outcomes.append((refused.message, refused.param))
    assert outcomes[0] == outcomes[1]
