"""The operator's cancel against the real llama.cpp server: the cancelled client is told, the
slot is slotgate's to give again at once, and llama.cpp stops generating."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import POLL_S, GateFactory, Llama, chat, eventually

pytestmark = pytest.mark.e2e


async def test_a_cancelled_stream_stops_llama_cpp_generating(
    start_gate: GateFactory, client: httpx.AsyncClient, llama: Llama, record_property: Any
) -> None:
    gate = await start_gate()
    chunks: list[bytes] = []
    first = asyncio.Event()

    async def stream() -> None:
        async with client.stream(
            "POST", gate.url + "/v1/chat/completions", json=chat(900, stream=True),
            headers={"x-request-id": "runaway-1"},
        ) as response:  # fmt: skip
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                first.set()

    running = asyncio.create_task(stream())
    await asyncio.wait_for(first.wait(), 60)
    assert len(await llama.busy_tasks()) == 1
    cancelled = await client.post(gate.url + "/admin/requests/runaway-1/cancel")
    cut_at = time.monotonic()
    assert cancelled.status_code == 200
    await asyncio.wait_for(running, 30)
    assert gate.service.admission.active == 0
    body = b"".join(chunks)
    assert b'"code":"cancelled_by_operator"' in body
    assert b"[DONE]" not in body
    # llama.cpp's own /slots: its slot idle again, long before 900 tokens could be done.
    await eventually(lambda: _idle(llama), timeout_s=10, every_s=POLL_S)
    freed_s = time.monotonic() - cut_at
    record_property("llama_cpp_freed_after_cancel_s", freed_s)
    print(f"\nllama.cpp idle {freed_s:.2f} s after the cancel (polled every {POLL_S} s)")  # noqa: T201
    assert freed_s <= 3.0
    # The slot serves the next request.
    again = await client.post(gate.url + "/v1/chat/completions", json=chat(4, stream=False))
    assert again.status_code == 200


async def _idle(llama: Llama) -> bool:
    return not await llama.busy_tasks()
