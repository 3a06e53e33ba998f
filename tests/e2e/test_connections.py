"""Against the real llama.cpp server: a client that pipelines and leaves costs it nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import POLL_S, GateFactory, Llama, Watch, chat, eventually
from tests.e2e.test_gate import generating

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("how", ["fin", "reset"])
async def test_a_pipelined_client_that_leaves_the_line_never_reaches_llama_cpp(
    start_gate: GateFactory, client: httpx.AsyncClient, llama: Llama, watching: Any, how: str
) -> None:
    gate = await start_gate()
    admission = gate.service.admission
    watch: Watch = watching()
    # A length nobody else asks for, so llama.cpp's /slots would show it had it run.
    body = json.dumps(chat(7, stream=False, content="Why is the sea salty?")).encode()
    quitter = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with generating(client, gate.url, chat(1000, stream=True)):
        async with generating(client, gate.url, chat(1000, stream=True)):
            prompts_before = (await llama.metrics())["prompt_tokens_total"]
            _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
            writer.write(quitter)
            await eventually(lambda: admission.queued == 1, timeout_s=5)
            await asyncio.sleep(0.2)  # settled in line, watching for its client
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # pipelined behind it
            await writer.drain()
            await asyncio.sleep(0.2)
            if how == "reset":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
            await eventually(lambda: admission.queued == 0, timeout_s=1)
        # A slot is free now: a waiter that had not really left would take it.
        await asyncio.sleep(2 * POLL_S)
        assert admission.active == 1
        assert len(await llama.busy_tasks()) == 1
    await llama.idle()

    assert (await llama.metrics())["prompt_tokens_total"] == prompts_before
    assert all(slot["params"]["n_predict"] == 1000 for slot in await llama.slots())
    assert watch.max_deferred == 0
