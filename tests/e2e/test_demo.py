"""What a newcomer sees first: the demo's chat answers are text, not template tokens."""

from __future__ import annotations

import httpx
import pytest
from slotgate.engine.process import LocalEngine

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


#: llama.cpp's own web UI sends tools of its own with every chat.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


async def test_a_chat_with_tools_as_llama_cpp_s_web_ui_sends_it_is_answered_through_the_demo(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    for stream in (False, True):
        response = await client.post(
            gate.url + "/v1/chat/completions",
            json={"messages": [SAY_HELLO], "tools": TOOLS, "max_tokens": 8, "stream": stream},
        )
        assert response.status_code == 200, response.text
        assert '"error"' not in response.text


async def test_the_demo_s_model_id_is_a_readable_name_not_a_path(
    engine: LocalEngine, start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    models = (await client.get(gate.url + "/v1/models")).json()
    assert [model["id"] for model in models["data"]] == ["gemma-3-270m"]
    answer = await client.post(
        gate.url + "/v1/chat/completions", json={"messages": [SAY_HELLO], "max_tokens": 4}
    )
    assert answer.json()["model"] == "gemma-3-270m"


async def test_the_demo_engine_s_jinja_template_formats_a_system_prompt_as_gemma_does(
    engine: LocalEngine, client: httpx.AsyncClient
) -> None:
    system = {"role": "system", "content": "Be brief."}
    response = await client.post(
        engine.url + "/apply-template", json={"messages": [system, SAY_HELLO]}
    )
    assert response.json()["prompt"] == (
        "<start_of_turn>user\nBe brief.\n\nSay hello<end_of_turn>\n<start_of_turn>model\n"
    )
