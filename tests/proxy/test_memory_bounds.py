"""The memory bounds docs/access-and-limits.md states, held under the hostile stand-in
(tests/support/hostile.py): whatever llama-server's side sends, slotgate holds at most its
bound per request."""

from __future__ import annotations

import tracemalloc
from typing import Any

import httpx
import pytest
from slotgate.proxy.assembly import MAX_ASSEMBLED_BYTES

from tests.conftest import (
    CHAT,
    GateFactory,
    answered_after_waiting,
    chat,
    waiting_before_hostile,
)
from tests.support.hostile import (
    CHAT_STREAM,
    PARTIAL_EVENT,
    Answer,
    Hostile,
    MiB,
    giant_stream,
    huge_error,
    huge_head,
    reply,
    sends,
    stream,
)


async def peak_of(asked: Any) -> int:
    """The most Python memory held at once while `asked` runs, over what was held before."""
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        await asked
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before


UPSTREAM_SIDE: dict[str, Answer] = {
    "a 20 MiB head": huge_head(20 * MiB),
    "a 200 MiB error body": huge_error(200 * MiB),
    "a 200 MiB chunked error body": huge_error(200 * MiB, chunked=True),
    "a response too many": sends(reply(200, b'{"n":1}') + reply(200, b"x" * MiB)),
    "a stream cut mid-event": stream(*CHAT_STREAM[:2], cut=PARTIAL_EVENT),
}


@pytest.mark.parametrize("misbehaviour", sorted(UPSTREAM_SIDE))
async def test_a_waiting_stream_holds_under_a_mebibyte_whatever_llama_server_sends(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient, misbehaviour: str
) -> None:
    gate = await waiting_before_hostile(start_gate, hostile)

    async def two() -> None:
        body = await answered_after_waiting(gate, hostile, client, UPSTREAM_SIDE[misbehaviour])
        assert len(body) < 64 * 1024 + 4096  # what reached the client: one bounded event

    assert await peak_of(two()) < MiB
    await gate.until(lambda: gate.service.admission.active == 0)


@pytest.mark.usefixtures("quiet_upstreams")
async def test_an_assembled_answer_holds_at_most_its_bound_of_a_200_mib_stream(
    start_gate: GateFactory, hostile: Hostile, client: httpx.AsyncClient
) -> None:
    gate = await waiting_before_hostile(start_gate, hostile)
    hostile.script.append(giant_stream(200 * MiB))

    async def one() -> None:
        answer = await client.post(gate.url + CHAT, json=chat())
        assert answer.status_code == 502
        assert str(MAX_ASSEMBLED_BYTES) in answer.json()["error"]["message"]

    assert await peak_of(one()) < MAX_ASSEMBLED_BYTES + 4 * MiB
    assert hostile.sent < 100 * MiB  # slotgate hung up past its bound, not at the end
