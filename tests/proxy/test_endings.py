"""The ways a request ends (a shutdown cut, a client leaving, an upstream failing mid-answer): what
the answer writer sends, what the access-log line says and whether the upstream connection is
pooled, in memory (tests/support/harness.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
from slotgate.asgi import Message
from slotgate.errors import Disconnected, Refusal
from slotgate.proxy.answer import Answer

from tests.support.harness import SSE, Client, FakeResponse, FakeUpstreamClient, Rig, chat_body


class SlowClient(Client):
    """A client too slow to read: the answer's end waits for its socket buffer to drain,
    which uvicorn does before it writes anything, so a send cut there wrote nothing."""

    def __init__(self, body: bytes = b"") -> None:
        super().__init__(body)
        self.at_end = asyncio.Event()

    async def send(self, message: Message) -> None:
        final = message["type"] == "http.response.body" and not message.get("more_body", False)
        if final and not self.at_end.is_set():
            self.at_end.set()
            await asyncio.Event().wait()
        self.sent.append(message)


def access_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    lines = [r for r in caplog.records if r.name == "slotgate.access"]
    assert len(lines) == 1, lines
    return vars(lines[0])


def final_messages(client: Client) -> list[Message]:
    return [m for m in client.sent if m["type"] == "http.response.body" and not m.get("more_body")]


async def until(condition: Any) -> None:
    async with asyncio.timeout(30):
        while not condition():
            await asyncio.sleep(0.001)


async def shutdown_cut(
    rig: Rig, client: Client, caplog: pytest.LogCaptureFixture, once: Callable[[], bool]
) -> dict[str, Any]:
    """The client's request, cut by a shutdown once `once()` holds; its access-log line. Told
    why, the request ends normally."""
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        call = asyncio.ensure_future(rig.call(client))
        await until(once)
        call.cancel()
        await call
        return access_line(caplog)


async def slot_held(
    *more: FakeResponse, stream: bool = True, **settings: Any
) -> tuple[Rig, asyncio.Event, asyncio.Future[None]]:
    """A rig whose one slot a request holds until the event returned is set; `more` are
    llama-server's answers after the holder's."""
    finish = asyncio.Event()
    held = FakeResponse(200, SSE, [b"data: [DONE]\n\n"], hold=finish)
    rig = Rig(FakeUpstreamClient(held, *more), **settings)
    holding = asyncio.ensure_future(rig.call(Client(chat_body(stream=stream))))
    await until(lambda: rig.admission.active == 1)
    return rig, finish, holding


async def test_a_shutdown_cut_while_a_whole_stream_waits_to_end_just_ends_it_logged_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    done = FakeResponse(200, SSE, [b"data: 1\n\n", b"data: [DONE]\n\n"])
    rig = Rig(FakeUpstreamClient(done))
    client = SlowClient(chat_body(stream=True))
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        task = asyncio.ensure_future(rig.call(client))
        await until(client.at_end.is_set)
        task.cancel()  # the drain timeout ran out, not the client leaving
        await asyncio.wait((task,), timeout=5)
        line = access_line(caplog)
    assert task.done()
    # The stream is ended as it was meant to be: no shutdown error after its [DONE].
    assert client.body == b"data: 1\n\ndata: [DONE]\n\n"
    assert len(final_messages(client)) == 1
    assert line["bytes_out"] == len(client.body)
    assert line["outcome"] == "served"
    assert rig.admission.active == 0


async def test_a_shutdown_cut_while_queued_counts_the_503_body_it_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig, finish, holding = await slot_held(keepalive_interval_s=0)
    waiter = Client(chat_body(stream=False))
    line = await shutdown_cut(rig, waiter, caplog, once=lambda: rig.admission.queued == 1)
    assert waiter.status == 503
    assert line["status"] == 503
    assert line["outcome"] == "shutdown"
    assert line["bytes_out"] == len(waiter.body) > 0
    assert rig.admission.queued == 0
    finish.set()
    await holding


async def test_a_shutdown_cut_after_a_stream_head_counts_the_event_it_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig, finish, holding = await slot_held(stream_head_after_s=0)
    waiter = Client(chat_body(stream=True))
    # Cut once the stream head went out while it waits.
    line = await shutdown_cut(rig, waiter, caplog, once=lambda: waiter.status == 200)
    comments = b"".join(
        m["body"] for m in waiter.sent if m.get("body", b"").startswith(b": queued")
    )
    assert b"shutting_down" in waiter.body
    assert waiter.ended
    assert line["status"] == 200
    assert line["outcome"] == "shutdown"
    # Keep-alive comments are slotgate's own and not counted; the closing event is.
    assert line["bytes_out"] == len(waiter.body) - len(comments) > 0
    finish.set()
    await holding


async def test_a_client_that_leaves_mid_relay_closes_the_connection_and_logs_what_it_got(
    caplog: pytest.LogCaptureFixture,
) -> None:
    finish = asyncio.Event()

    class Endless(FakeResponse):
        async def readany(self) -> bytes:
            if self._chunks:
                return self._chunks.pop(0)
            await finish.wait()
            return b""

    endless = Endless(200, SSE, [b"data: 1\n\n"])
    rig = Rig(FakeUpstreamClient(endless))
    client = Client(chat_body(stream=True))
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        task = asyncio.ensure_future(rig.call(client))
        await until(lambda: client.body == b"data: 1\n\n")
        client.gone.set()
        await task
        line = access_line(caplog)
    assert endless.closed  # never pooled: llama-server cancels the generation
    assert not endless.released
    assert rig.admission.active == 0
    assert line["outcome"] == "client_gone"
    assert line["status"] == 200
    assert line["bytes_out"] == len(b"data: 1\n\n")
    assert line["slot_hold_s"] is not None
    assert line["queue_wait_s"] is not None


async def test_an_in_stream_upstream_failure_logs_the_200_head_and_every_byte_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cut = FakeResponse(200, SSE, [b'data: {"a": 1}\n\n', b'data: {"b'], Disconnected("x"))
    rig = Rig(FakeUpstreamClient(cut))
    client = Client(chat_body(stream=True))
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        await rig.call(client)
        line = access_line(caplog)
    assert line["status"] == 200
    assert line["outcome"] == "upstream_failed"
    assert line["upstream_status"] == 200
    assert line["bytes_out"] == len(client.body)
    assert len(final_messages(client)) == 1


async def test_a_client_that_leaves_during_the_exact_count_gives_back_its_place_and_bytes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    never = asyncio.Event()
    counting = FakeResponse(200, [], [b'{"prompt": "hi"}'], hold=never)  # /apply-template hangs
    rig, finish, holding = await slot_held(counting, stream=False, queue_body_bytes=1 << 20)
    waiter = Client(chat_body(stream=True))
    rig.admission.resize_budget(4096)  # from now on requests are counted
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        waiting = asyncio.ensure_future(rig.call(waiter))
        await until(lambda: len(rig.upstream._client.requests) == 2)  # type: ignore[attr-defined]
        assert rig.admission.queued == 1
        assert rig.proxy.body_bytes.held > 0
        waiter.gone.set()
        await waiting
        line = access_line(caplog)
    assert counting.closed  # the count's exchange is abandoned, its connection closed
    assert rig.admission.queued == 0
    assert rig.proxy.body_bytes.held == 0
    assert waiter.sent == []
    assert line["outcome"] == "client_gone"
    assert line["status"] == 0
    assert line["slot_hold_s"] is None
    finish.set()
    await holding
    assert rig.admission.active == 0


async def test_a_client_that_leaves_during_the_exact_count_gives_back_its_slot_and_tokens() -> None:
    never = asyncio.Event()
    counting = FakeResponse(200, [], [b'{"prompt": "hi"}'], hold=never)
    rig = Rig(FakeUpstreamClient(counting))
    rig.admission.resize_budget(4096)
    client = Client(chat_body(stream=True))
    task = asyncio.ensure_future(rig.call(client))
    await until(lambda: len(rig.upstream._client.requests) == 1)  # type: ignore[attr-defined]
    assert rig.admission.active == 1
    assert rig.admission.committed_tokens > 0
    client.gone.set()
    await task
    assert counting.closed
    assert rig.admission.active == 0
    assert rig.admission.committed_tokens == 0
    assert client.sent == []


async def test_an_upstream_refusal_after_the_stream_head_is_an_event_and_pools_its_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = b'{"error": {"code": 400, "message": "the prompt exceeds the context"}}'
    refused = FakeResponse(400, [(b"content-type", b"application/json")], [error])
    rig, finish, holding = await slot_held(refused, stream_head_after_s=0)
    waiter = Client(chat_body(stream=True))
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        waiting = asyncio.ensure_future(rig.call(waiter))
        await until(lambda: waiter.status == 200)
        finish.set()
        await asyncio.gather(holding, waiting)
        lines = [vars(r) for r in caplog.records if r.name == "slotgate.access"]
    line = next(x for x in lines if x["upstream_status"] == 400)
    assert waiter.body.endswith(b"data: " + error + b"\n\n")
    assert len(final_messages(waiter)) == 1
    assert refused.released  # a complete answer: its connection may serve the next request
    assert not refused.closed
    assert line["status"] == 200
    assert line["outcome"] == "upstream_error"
    comments = sum(len(m["body"]) for m in waiter.sent if m.get("body", b"").startswith(b":"))
    assert line["bytes_out"] == len(waiter.body) - comments
    assert line["queue_wait_s"] > 0
    assert rig.admission.active == 0


async def test_a_client_that_leaves_mid_body_takes_nothing_and_reaches_nobody(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class HalfBody(Client):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[Message] = [
                {"type": "http.request", "body": b'{"messages": [', "more_body": True},
                {"type": "http.disconnect"},
            ]

        async def receive(self) -> Message:
            return self.messages.pop(0)

    rig = Rig(FakeUpstreamClient(), queue_body_bytes=1 << 20)
    client = HalfBody()
    with caplog.at_level(logging.INFO, logger="slotgate.access"):
        await rig.call(client)
        line = access_line(caplog)
    assert client.sent == []
    assert rig.upstream._client.requests == []  # type: ignore[attr-defined]
    assert rig.admission.active == rig.admission.queued == 0
    assert rig.proxy.body_bytes.held == 0
    assert line["outcome"] == "client_gone"
    assert line["status"] == 0
    assert line["bytes_out"] == 0
    assert line["queue_wait_s"] is None


async def test_an_answer_cut_while_its_end_is_sent_says_so_and_is_ended_as_meant() -> None:
    client = SlowClient()
    answer = Answer(client.send)
    await answer.start(200, SSE, stream=True)
    await answer.relay(b"data: [DONE]\n\n")
    ending = asyncio.ensure_future(answer.end())
    await until(client.at_end.is_set)
    assert answer.ending
    assert not answer.ended
    ending.cancel()
    cut = Refusal(503, "unavailable_error", "shutting_down", "shut down", "internal")
    await answer.final_words(cut, "openai", [])
    assert answer.ended
    assert not answer.ending
    assert client.body == b"data: [DONE]\n\n"
    assert len(final_messages(client)) == 1
    await answer.final_words(cut, "openai", [])  # nothing after the end
    assert len(client.sent) == 3


async def test_a_plain_answer_whole_but_for_its_end_when_cut_is_ended_not_truncated() -> None:
    body = b'{"choices": []}'
    done = FakeResponse(
        200, [(b"content-type", b"application/json"), (b"content-length", b"15")], [body]
    )
    rig = Rig(FakeUpstreamClient(done))
    client = SlowClient(chat_body(stream=False))
    task = asyncio.ensure_future(rig.call(client))
    await until(client.at_end.is_set)
    task.cancel()
    await asyncio.wait((task,), timeout=5)
    assert [m["body"] for m in final_messages(client)] == [body]
    assert not task.cancelled()  # not a traceback per request in uvicorn's log
