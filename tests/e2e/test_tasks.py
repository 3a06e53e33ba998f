"""Every way a request asks llama.cpp for several tasks is counted before it goes there."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import POLL_S, GateFactory, Watch, chat

pytestmark = pytest.mark.e2e


async def test_requests_asking_for_several_tasks_never_make_llama_cpp_defer_one(
    start_gate: GateFactory, client: httpx.AsyncClient, watching: Any, record_property: Any
) -> None:
    gate = await start_gate(max_queue=0)
    watch: Watch = watching()
    native = {"n_predict": 24, "ignore_eos": True}
    asks = [
        # n_cmpl is llama.cpp's own name for n; it once took one slot here and two there.
        ("/v1/chat/completions", chat(24, stream=True, n_cmpl=2)),
        ("/v1/chat/completions", chat(24, stream=False, n_cmpl=2)),
        ("/v1/completions", {"prompt": "One,", "n_cmpl": 2, "max_tokens": 24, "ignore_eos": True}),
        ("/completion", {"prompt": ["One,", "Two,"], **native}),
        ("/completion", {"prompt": "One,", "n": 2, **native}),
    ]
    answers = await asyncio.gather(
        *(client.post(gate.url + path, json=body) for path, body in asks)
    )
    await asyncio.sleep(POLL_S)  # one more look at llama.cpp after the last answer
    assert [a.status_code for a in answers] == [200] * len(asks)
    assert len(answers[1].json()["choices"]) == 2
    assert len(answers[2].json()["choices"]) == 2
    assert watch.samples >= 2
    assert watch.max_deferred == 0
    record_property("llamacpp_requests_deferred_max_multi_task", watch.max_deferred)
