"""A llama.cpp whose 4 slots share one 1024-token KV cache: a burst that needs more than the
cache fails every request when sent straight to it, and succeeds whole through slotgate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from slotgate.engine.model import demo_model
from slotgate.engine.process import LocalEngine, find_binary
from slotgate.settings import Settings

from tests.conftest import RunningGate, serve
from tests.e2e.conftest import eventually

pytestmark = pytest.mark.e2e

CTX = 1024
SLOTS = 4


@pytest.fixture(scope="module")
def unified() -> Iterator[LocalEngine]:
    """llama.cpp as llama-server runs without -np: several slots, one (unified) cache."""
    engine = LocalEngine(
        demo_model(), parallel=SLOTS, ctx_size=CTX, threads=1, binary=find_binary(),
        kv_unified=True,
    )  # fmt: skip
    engine.start()
    yield engine
    engine.stop()


def story(i: int) -> dict[str, Any]:
    """About 335 prompt tokens (gemma) and exactly 80 to generate: 4 of them need 1660."""
    text = f"Request {i}. " + ("Write a short story about a lighthouse keeper. " * 40)[:1600]
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 80,
        "ignore_eos": True,
    }


@contextlib.asynccontextmanager
async def budgeted_gate(unified: LocalEngine) -> AsyncIterator[RunningGate]:
    """slotgate before the unified cache with its KV budget, once ready; stopped at the end."""
    settings = Settings(
        _env_file=None, llama_server_url=unified.url, kv_budget_tokens=unified.kv_budget_tokens,
        keepalive_interval_s=0, log_level="warning",
    )  # fmt: skip
    gate = await serve(settings)
    try:
        await eventually(lambda: gate.service.upstream.ready, timeout_s=10)
        yield gate
    finally:
        await gate.stop()


async def burst(client: httpx.AsyncClient, url: str) -> list[httpx.Response]:
    return await asyncio.gather(
        *(client.post(url + "/v1/chat/completions", json=story(i)) for i in range(SLOTS))
    )


async def test_a_burst_too_big_for_a_shared_cache_fails_directly_and_succeeds_through_the_gate(
    unified: LocalEngine,
) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        direct = await burst(client, unified.url)
        # Straight to llama.cpp, every request in flight fails once the cache runs out.
        assert [r.status_code for r in direct] == [500] * SLOTS
        assert all("Context size has been exceeded" in r.text for r in direct)

        async with budgeted_gate(unified) as gate:
            assert gate.service.admission.budget_tokens == CTX
            gated = await burst(client, gate.url)
            assert [r.status_code for r in gated] == [200] * SLOTS
            assert all(r.json()["usage"]["completion_tokens"] == 80 for r in gated)
            assert gate.service.admission.committed_tokens == 0

            # A prompt longer than the whole cache is refused at once, as llama.cpp words it.
            long = {"messages": [{"role": "user", "content": "lighthouse " * 1200}]}
            refused = await client.post(gate.url + "/v1/chat/completions", json=long)
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["type"] == "exceed_context_size_error"
            assert error["n_ctx"] == CTX
            assert error["n_prompt_tokens"] > CTX


async def test_requests_that_set_no_limit_beside_a_small_max_tokens_never_exceed_the_cache(
    unified: LocalEngine,
) -> None:
    # llama.cpp reads n_predict before its aliases, and -1 there is no limit: each of these
    # generates until its slot's context (the whole cache) is full, whatever max_tokens says.
    # Two are enough: admitted together they overflow the one cache they share (and each runs
    # to the end of the context, so every extra one costs a whole cache of tokens).
    body = {
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "n_predict": -1,
        "max_tokens": 3,
        "ignore_eos": True,
    }
    async with budgeted_gate(unified) as gate, httpx.AsyncClient(timeout=900) as client:
        answers = await asyncio.gather(
            *(client.post(gate.url + "/v1/chat/completions", json=body) for _ in range(2))
        )
        exceeded = [r for r in answers if "Context size has been exceeded" in r.text]
        assert exceeded == []
        assert [r.status_code for r in answers] == [200, 200]
        assert all(r.json()["usage"]["completion_tokens"] > 3 for r in answers)
        assert gate.service.admission.committed_tokens == 0
