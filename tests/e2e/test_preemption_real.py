"""Preemption before the first token against the real llama.cpp server: an interactive chat
takes the slot of a batch stream still reading its long prompt; that stream is sent again and
answers as it would have (temperature 0), and llama.cpp ends up idle."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import GateFactory, Llama, chat

pytestmark = pytest.mark.e2e

#: A prompt long enough that llama.cpp reads it for a while before the first token.
LONG = "apple " * 850


def batch(n: int) -> dict[str, Any]:
    return chat(16, stream=True, content=f"{n} {LONG}", temperature=0, seed=1)


async def streamed_text(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
    parts: list[str] = []
    headers = {"x-priority": "batch"}
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices", [])
                parts.extend(choice.get("delta", {}).get("content") or "" for choice in choices)
    return "".join(parts)


async def test_a_chat_preempts_a_batch_stream_before_its_first_token_and_it_answers_the_same(
    start_gate: GateFactory, client: httpx.AsyncClient, llama: Llama
) -> None:
    gate = await start_gate(preempt_after_s=0.2, max_queue=0)
    streams = [asyncio.create_task(streamed_text(client, gate.url, batch(n))) for n in range(2)]
    await asyncio.sleep(0)
    async with asyncio.timeout(30):
        while gate.service.admission.active < 2:
            await asyncio.sleep(0.01)
    answer = await client.post(
        gate.url + "/v1/chat/completions", json=chat(4, stream=False, content="Hi", temperature=0)
    )
    assert answer.status_code == 200
    texts = await asyncio.gather(*streams)
    assert gate.service.proxy.preemption is not None
    assert gate.service.proxy.preemption.count == 1
    # The one preempted was sent again and answered as llama.cpp answers it alone.
    for n, text in enumerate(texts):
        assert text == await streamed_text(client, llama.url, batch(n))
    await llama.idle()
