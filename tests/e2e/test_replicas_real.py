"""`slotgate --demo --replicas 2`: two real llama.cpp engines behind the one gate."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

from bench.procs import free_port
from tests.e2e.conftest import chat

pytestmark = pytest.mark.e2e


async def test_two_demo_replicas_serve_behind_one_gate_and_stop_with_it(
    tmp_path: Path, client: httpx.AsyncClient
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER_BIN"}
    env.update(PORT=str(port), LOG_LEVEL="warning", PATH=os.defpath)  # xllamacpp, no binary
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "slotgate", "--demo", "--replicas", "2", "--parallel", "1",
        "--ctx-size", "1024", "--threads", "1",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(120):
            while True:
                assert proc.returncode is None
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(base + "/readyz")).status_code == 200:
                        pool = (await client.get(base + "/admission")).json()
                        if all(upstream["ready"] for upstream in pool["upstreams"]):
                            break
                await asyncio.sleep(0.2)
        upstreams = pool["upstreams"]
        assert len(upstreams) == 2
        assert len({upstream["url"] for upstream in upstreams}) == 2
        assert [upstream["capacity"] for upstream in upstreams] == [1, 1]
        assert pool["capacity"] == 2

        # One engine's only slot held by a stream: the next request runs on the other.
        async with client.stream(
            "POST", base + "/v1/chat/completions", json=chat(32, stream=True)
        ) as held:
            chunks = held.aiter_raw()
            body = await anext(chunks)
            other = await client.post(base + "/v1/chat/completions", json=chat(4, stream=False))
            body += b"".join([chunk async for chunk in chunks])
        assert held.status_code == 200
        assert body.endswith(b"data: [DONE]\n\n")
        assert other.status_code == 200, other.text
        assert other.json()["usage"]["completion_tokens"] == 4
        for upstream in upstreams:
            metrics = (await client.get(upstream["url"] + "/metrics")).text
            [predicted] = re.findall(r"^llamacpp:tokens_predicted_total (\S+)$", metrics, re.M)
            assert float(predicted) > 0, upstream["url"]

        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
        for upstream in upstreams:
            with pytest.raises(httpx.ConnectError):
                await client.get(upstream["url"] + "/health")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
