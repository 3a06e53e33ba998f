"""Against the real llama.cpp server: a client that pipelines and leaves costs it nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import GateFactory, Llama, chat, eventually
from tests.e2e.test_gate import assert_a_waiter_that_leaves_never_reaches_llama_cpp

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("how", ["fin", "reset"])
async def test_a_pipelined_client_that_leaves_the_line_never_reaches_llama_cpp(
    start_gate: GateFactory, client: httpx.AsyncClient, llama: Llama, watching: Any, how: str
) -> None:
    gate = await start_gate()
    # A length nobody else asks for, so llama.cpp's /slots would show it had it run.
    body = json.dumps(chat(7, stream=False, content="Why is the sea salty?")).encode()
    quitter = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )

    async def leave() -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", gate.port)
        writer.write(quitter)
        await eventually(lambda: gate.service.admission.queued == 1, timeout_s=5)
        await asyncio.sleep(0.2)  # settled in line, watching for its client
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # pipelined behind it
        await writer.drain()
        await asyncio.sleep(0.2)
        if how == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    await assert_a_waiter_that_leaves_never_reaches_llama_cpp(
        gate, client, llama, watching(), leave
    )
