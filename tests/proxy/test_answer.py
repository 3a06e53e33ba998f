"""The request path's own logic, in memory (tests/support/harness.py): the answer writer, the slot
scope, and the relay modes against a fake upstream."""

from __future__ import annotations

import asyncio

import pytest
from slotgate.errors import AnswerStarted, Disconnected, Refusal
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.proxy.answer import Answer

from tests.support.harness import SSE, Client, FakeResponse, FakeUpstreamClient, Rig, chat_body

BROKEN = Refusal(502, "server_error", "upstream_failed", "llama-server broke off", "upstream_error")


async def test_the_answer_writer_refuses_a_second_head() -> None:
    client = Client()
    answer = Answer(client.send)
    await answer.start(200, [])
    with pytest.raises(AnswerStarted):
        await answer.start(500, [])
    assert [m["type"] for m in client.sent] == ["http.response.start"]
    assert answer.status == 200


async def test_an_error_after_a_stream_head_is_an_event_on_an_event_boundary() -> None:
    client = Client()
    answer = Answer(client.send)
    await answer.start(200, SSE, stream=True)
    await answer.relay(b'data: {"a": 1}\n\ndata: {"cut')  # the upstream stopped mid-event
    await answer.refuse(BROKEN, "openai", [])
    assert client.status == 200  # one head: the error went in-stream
    assert client.body.startswith(b'data: {"a": 1}\n\ndata: {"cut\n\ndata: {"error"')
    assert client.ended
    assert answer.bytes_out == len(client.body)


async def test_a_refusal_before_any_head_is_a_whole_answer_with_its_status() -> None:
    client = Client()
    answer = Answer(client.send)
    await answer.refuse(BROKEN, "openai", [(b"x-request-id", b"r1")])
    assert client.status == 502
    assert b'"upstream_failed"' in client.body
    assert client.ended


async def test_the_slot_scope_releases_on_every_way_out() -> None:
    admission = Admission(QueuePolicy())
    admission.resize(1)

    async with admission.enter(1) as ticket:
        assert admission.active == 1
    assert admission.active == 0

    with pytest.raises(ValueError, match="boom"):
        async with admission.enter(1):
            raise ValueError("boom")
    assert admission.active == 0

    async def holds() -> None:
        async with admission.enter(1):
            await asyncio.Event().wait()

    task = asyncio.ensure_future(holds())
    await asyncio.sleep(0)
    assert admission.active == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert admission.active == 0

    async with admission.enter(1) as ticket:
        ticket.release()  # early, as when llama-server has sent its last byte
        assert admission.active == 0
        second = admission.enter(1)
        assert second.admitted  # the slot went on at once, and the scope's exit leaves it be
    assert admission.active == 1
    second.release()


async def test_a_stream_cut_mid_event_ends_with_an_error_event_and_frees_the_slot() -> None:
    cut = FakeResponse(
        200, SSE, [b'data: {"a": 1}\n\n', b'data: {"b'], failure=Disconnected("closed")
    )
    rig = Rig(FakeUpstreamClient(cut))
    client = Client(chat_body(stream=True))
    await rig.call(client)
    assert client.status == 200
    assert client.body.startswith(b'data: {"a": 1}\n\ndata: {"b\n\ndata: {"error"')
    assert client.ended
    assert cut.closed  # a broken exchange closes its connection, never pools it
    assert rig.admission.active == 0


async def test_a_relayed_answer_releases_its_connection_and_slot() -> None:
    done = FakeResponse(200, SSE, [b"data: 1\n\n", b"data: [DONE]\n\n"])
    rig = Rig(FakeUpstreamClient(done))
    client = Client(chat_body(stream=True))
    await rig.call(client)
    assert client.body == b"data: 1\n\ndata: [DONE]\n\n"
    assert done.released
    assert not done.closed
    assert rig.admission.active == 0


async def test_an_upstream_that_cannot_be_reached_is_a_503_and_frees_the_slot() -> None:
    from slotgate.errors import ConnectFailed

    rig = Rig(FakeUpstreamClient(ConnectFailed("refused")))
    client = Client(chat_body(stream=True))
    await rig.call(client)
    assert client.status == 503
    assert client.ended
    assert rig.admission.active == 0


async def test_a_client_that_leaves_while_queued_frees_its_place_and_the_holder_its_slot() -> None:
    finish = asyncio.Event()
    held = FakeResponse(200, SSE, [b"data: [DONE]\n\n"], hold=finish)
    rig = Rig(FakeUpstreamClient(held), keepalive_interval_s=0)
    holder, waiter = Client(chat_body(stream=True)), Client(chat_body(stream=True))
    holding = asyncio.ensure_future(rig.call(holder))
    while rig.admission.active == 0:
        await asyncio.sleep(0.001)
    waiting = asyncio.ensure_future(rig.call(waiter))
    while rig.admission.queued == 0:
        await asyncio.sleep(0.001)
    waiter.gone.set()  # noticed by the request's watch, which cancels its task
    await waiting
    assert rig.admission.queued == 0
    assert waiter.sent == []  # nobody left to answer
    finish.set()
    await holding
    assert holder.body == b"data: [DONE]\n\n"
    assert rig.admission.active == 0
