"""Hypothesis throws arbitrary bodies, paths and headers at the gate: slotgate never answers 500."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slotgate.intake.endpoints import ENDPOINTS
from slotgate.settings import Settings

from tests.conftest import RunningGate, serve
from tests.support.standin import StandIn


class Background:
    """The stand-in and slotgate on an event loop of their own, so a sync test can drive them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.standin = StandIn(tokens=1, token_delay_s=0)
        self.gate: RunningGate = self.run(self._start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self) -> RunningGate:
        await self.standin.start()
        gate = await serve(
            Settings(
                _env_file=None,
                llama_server_url=self.standin.url,
                log_level="error",
                keepalive_interval_s=0,
                max_queue=0,
            )
        )
        await gate.until(lambda: gate.service.upstream.ready)
        return gate

    def close(self) -> None:
        self.run(self.gate.stop())
        self.run(self.standin.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def background() -> Iterator[Background]:
    running = Background()
    yield running
    running.close()


@pytest.fixture(scope="module")
def gate_http(background: Background) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=background.gate.url, timeout=30) as client:
        yield client


keys = st.sampled_from(
    ["messages", "stream", "n", "max_tokens", "prompt", "input", "content", "documents",
     "n_predict", "model", "temperature", "stream_options"]
)  # fmt: skip
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text()
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
)
objects = st.dictionaries(keys, values, max_size=6)
bodies = st.one_of(
    objects.map(lambda o: json.dumps(o, allow_nan=True).encode()),
    st.binary(max_size=300),
    values.map(lambda v: json.dumps(v).encode()),
)
content_types = st.sampled_from(
    ["application/json", "text/plain", "application/xml", "multipart/form-data; boundary=x", "",
     "application/json; charset=latin-1", "application/vnd.api+json"]
)  # fmt: skip


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(ENDPOINTS)), body=bodies, content_type=content_types)
def test_admitted_routes_never_answer_500(
    gate_http: httpx.Client, background: Background, path: str, body: bytes, content_type: str
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = gate_http.post(path, content=body, headers=headers)
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert "error" in response.json()


# Any text, percent-encoded except for the characters that make paths interesting: dots,
# slashes and percent signs, so that "..", "%2e%2e", "%2F" and broken escapes all turn up.
segments = st.one_of(
    st.sampled_from(["..", ".", "%2e%2e", "%2E.", "%2f", "%5c", "v1", "chat", "completions", "%"]),
    st.text(max_size=10).map(lambda text: quote(text, safe="./%")),
)


@settings(deadline=None)
@given(
    parts=st.lists(segments, min_size=1, max_size=5),
    method=st.sampled_from(["GET", "POST", "DELETE"]),
)
def test_arbitrary_paths_never_get_500_and_never_escape_the_root(
    background: Background, parts: list[str], method: str
) -> None:
    target = "/" + "/".join(parts)
    connection = http.client.HTTPConnection("127.0.0.1", background.gate.port, timeout=30)
    try:
        connection.request(method, target, body=b"{}")
        status = connection.getresponse().status
    finally:
        connection.close()
    assert status < 500, (target, status)
    # Whatever reached the stand-in stayed inside its root: no dot segment survived the gate.
    for seen in background.standin.seen:
        assert "/../" not in seen.path + "/"
        assert "/./" not in seen.path + "/"
