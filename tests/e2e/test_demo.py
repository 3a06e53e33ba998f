"""What a newcomer sees first: the demo's chat answers are text, not template tokens."""

from __future__ import annotations

import httpx
import pytest
from slotgate.engine import LocalEngine

from tests.e2e.conftest import GateFactory

pytestmark = pytest.mark.e2e

SAY_HELLO = {"role": "user", "content": "Say hello"}


async def test_the_demo_engine_formats_a_chat_with_gemma_s_turns(
    engine: LocalEngine, client: httpx.AsyncClient
) -> None:
    response = await client.post(engine.url + "/apply-template", json={"messages": [SAY_HELLO]})

    assert response.json()["prompt"] == (
        "<start_of_turn>user\nSay hello<end_of_turn>\n<start_of_turn>model\n"
    )


async def test_a_chat_with_the_demo_through_slotgate_carries_no_chatml_tokens(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()

    response = await client.post(
        gate.url + "/v1/chat/completions",
        json={"messages": [SAY_HELLO], "max_tokens": 32, "temperature": 0},
    )

    assert response.status_code == 200
    answer = response.json()["choices"][0]["message"]["content"]
    assert answer.strip()
    assert "<|im_start|>" not in answer
    assert "<|im_end|>" not in answer
