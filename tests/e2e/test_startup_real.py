"""The real llama.cpp server starting behind slotgate: once it answers, nobody gets a 503 for
it; before anything listens at its address, a request is told so at once."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import slotgate.engine.process
from slotgate.engine.process import LocalEngine, free_port
from slotgate.settings import Settings

from tests.conftest import CHAT, serve
from tests.e2e.conftest import chat

pytestmark = pytest.mark.e2e


async def test_requests_while_llama_cpp_loads_wait_and_a_client_that_saw_health_is_served(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setattr(slotgate.engine.process, "free_port", lambda: port)
    settings = Settings(
        _env_file=None,
        llama_server_url=f"http://127.0.0.1:{port}",
        startup_wait_s=180,
        keepalive_interval_s=0,
        log_level="warning",
    )
    gate = await serve(settings)
    fleet = gate.service.fleet
    # Nothing has listened there yet: no llama-server that is loading, perhaps a wrong URL, so
    # a request is told so at once (and to retry) rather than kept waiting for it.
    async with asyncio.timeout(10):
        while fleet.unreached is None:
            await asyncio.sleep(0.01)
    refused = await client.post(gate.url + CHAT, json=chat(4, stream=False))
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "1"
    assert settings.llama_server_url in refused.json()["error"]["message"]
    local = LocalEngine.from_args(model=None, demo=True, parallel=2, ctx_size=2048, threads=1)
    starting = asyncio.create_task(asyncio.to_thread(local.start))
    try:
        health_statuses: set[int] = set()
        early: list[asyncio.Task[httpx.Response]] = []
        while True:
            health = await client.get(gate.url + "/health")
            health_statuses.add(health.status_code)
            if not early and fleet.unreached is None:
                # llama.cpp answers (loading, most likely): from now on requests wait for it.
                early = [
                    asyncio.create_task(client.post(gate.url + CHAT, json=chat(4, stream=stream)))
                    for stream in (False, True)
                ]
            if health.status_code == 200:
                break
            await asyncio.sleep(0.01)
        # At once, as an orchestrator's client would.
        first = await client.post(gate.url + CHAT, json=chat(4, stream=False))
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["completion_tokens"] == 4
        for answer in await asyncio.gather(*early):
            assert answer.status_code == 200, answer.text
            assert b'"error"' not in answer.content
        assert 503 in health_statuses  # it was seen starting, through slotgate
        await starting
    finally:
        with contextlib.suppress(Exception):
            await starting
        await asyncio.to_thread(local.stop)
        await gate.stop()
