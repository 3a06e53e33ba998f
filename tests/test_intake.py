"""Request bodies read into a demand and the body to forward, big ones in a worker process."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from slotgate import intake
from slotgate.endpoints import ENDPOINTS
from slotgate.errors import BadRequest
from slotgate.intake import OFF_LOOP_BYTES, take, take_off_loop

CHAT = ENDPOINTS["/v1/chat/completions"]


def big(**fields: Any) -> bytes:
    body = {"messages": [{"role": "user", "content": "x" * OFF_LOOP_BYTES}], **fields}
    return orjson.dumps(body)


def test_a_non_streamed_completion_is_rewritten_to_ask_for_a_stream() -> None:
    taken = take(CHAT, b'{"messages": []}', 2, assemble=True)
    assert taken.assembled is True
    assert orjson.loads(taken.body)["stream"] is True
    streamed = take(CHAT, b'{"messages": [], "stream": true}', 2, assemble=True)
    assert (streamed.assembled, streamed.body) == (False, b'{"messages": [], "stream": true}')
    as_sent = take(CHAT, b'{"messages": []}', 2, assemble=False)
    assert (as_sent.assembled, as_sent.body) == (False, b'{"messages": []}')


async def test_a_big_body_is_read_in_a_worker_process_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = big(n_cmpl=2)
    expected = take(CHAT, body, 4, assemble=True)

    def not_here(*args: object, **kwargs: object) -> None:
        raise AssertionError("read on the event loop")

    # The worker process has its own `take`: this one must not be called for a big body...
    monkeypatch.setattr(intake, "take", not_here)
    assert await take_off_loop(CHAT, body, 4, assemble=True) == expected
    # ...and must be for a small one.
    with pytest.raises(AssertionError, match="event loop"):
        await take_off_loop(CHAT, b'{"messages": []}', 4, assemble=True)


async def test_a_big_body_refused_in_the_worker_is_refused_with_its_message_and_param() -> None:
    with pytest.raises(BadRequest, match="at most 2") as caught:
        await take_off_loop(CHAT, big(n_cmpl=3), 2, assemble=True)
    assert caught.value.param == "n_cmpl"
    with pytest.raises(BadRequest, match="not valid JSON"):
        await take_off_loop(CHAT, big()[:-1], 2, assemble=True)


async def test_without_a_working_worker_big_bodies_are_read_on_the_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_pool() -> None:
        raise OSError("no /dev/shm")

    monkeypatch.setattr(intake, "_pool", no_pool)
    monkeypatch.setattr(intake, "_broken", False)
    body = big(n_cmpl=2)
    assert await take_off_loop(CHAT, body, 4, assemble=True) == take(CHAT, body, 4, assemble=True)
    assert "cannot parse big bodies in a worker process" in caplog.text
    assert intake._broken is True  # and it is not tried again for every body
