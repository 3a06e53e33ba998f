"""Assembled answers equal llama.cpp's own: every request sent straight to the real server,
non-streamed, and through slotgate (which asks for a stream and assembles the answer), with the
JSON compared key by key, values too, but for those that differ between any two requests."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from slotgate.engine.model import demo_model
from slotgate.engine.process import LocalEngine, free_port
from slotgate.settings import Settings

from tests.conftest import serve
from tests.e2e.conftest import GateFactory, Llama, eventually

pytestmark = pytest.mark.e2e

CHAT, OPENAI, NATIVE = "/v1/chat/completions", "/v1/completions", "/completion"
ROUTES = (NATIVE, OPENAI, CHAT)
#: Keys whose values differ between any two requests: compared for presence only.
LOOSE = frozenset({"id", "created", "system_fingerprint", "timings", "cached_tokens", "id_slot"})
#: Headers that differ between any two answers, or are the connection's, not the answer's;
#: Server, which slotgate leaves off every answer it relays, assembled or not; and the request
#: id, which slotgate gives every answer under both names SDKs read (x-request-id, request-id).
HEADERS_LOOSE = frozenset(
    {"date", "content-length", "keep-alive", "connection", "x-request-id", "request-id",
     "transfer-encoding", "server"}
)  # fmt: skip
#: Options whose non-streamed answer a stream cannot reproduce: slotgate forwards requests
#: carrying them as sent (docs/operating.md: non-streamed completions travel upstream as streams).
#: `__verbose` comes from a llama-server started with --verbose or a body's `verbose`: such
#: answers go as sent (tests/proxy/test_assembled_answers.py, and the verbose tests at the end of
#: this file).
FORWARDED_AS_SENT: frozenset[str] = frozenset()

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
#: option name -> (routes it applies to, what it adds to the request)
OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "plain": (ROUTES, {}),
    "response_fields": (
        (NATIVE,),
        {"response_fields": ["content", "generation_settings/n_predict", "tokens"]},
    ),
    "n_probs": (ROUTES, {"n_probs": 2}),
    "post_sampling_probs": ((NATIVE,), {"n_probs": 2, "post_sampling_probs": True}),
    "logprobs": ((OPENAI,), {"logprobs": 2}),
    "chat_logprobs": ((CHAT,), {"logprobs": True, "top_logprobs": 2}),
    "return_tokens": (ROUTES, {"return_tokens": True}),
    "timings_per_token": (ROUTES, {"timings_per_token": True}),
    "return_progress": (ROUTES, {"return_progress": True, "return_tokens": True}),
    "id_slot": (ROUTES, {"id_slot": 1}),
    "multiple_prompts": ((NATIVE, OPENAI), {"prompt": ["Say hi", "Say yes"]}),
    "n": (ROUTES, {"n": 2}),
    "n_cmpl": ((CHAT,), {"n_cmpl": 2}),
    "stop_word": (ROUTES, {"stop": [" the"]}),
    "usage_not_asked": ((CHAT, OPENAI), {"stream_options": {"include_usage": False}}),
    "tools": ((CHAT,), {"tools": [TOOL]}),
    "tool_required": ((CHAT,), {"tools": [TOOL], "tool_choice": "required"}),
    "reasoning": ((CHAT,), {"reasoning_format": "deepseek"}),
    "json_schema": ((NATIVE, CHAT), {"json_schema": {"type": "object"}}),
    "bad_grammar": (ROUTES, {"grammar": "root ::= ("}),
    "bad_json_schema": ((CHAT,), {"json_schema": {"type": "nope"}}),
    "bad_messages": ((CHAT,), {"messages": [{"role": "nobody"}]}),
    "context_exceeded": ((NATIVE, OPENAI), {"prompt": "x " * 1500}),
}
CASES = [
    pytest.param(route, name, id=f"{route}:{name}")
    for name, (routes, _) in OPTIONS.items()
    for route in routes
]


def request(route: str, name: str) -> dict[str, Any]:
    body: dict[str, Any] = {"temperature": 0, "seed": 14, "n_predict": 6, "max_tokens": 6}
    if route == CHAT:
        body["messages"] = [{"role": "user", "content": "Say hi"}]
    else:
        body["prompt"] = "Say hi"
    body.update(OPTIONS[name][1])
    return body


def differences(direct: Any, gated: Any, path: str = "") -> list[str]:
    """Where two answers differ: keys, nesting, list lengths and values (LOOSE: keys only)."""
    if isinstance(direct, dict) and isinstance(gated, dict):
        found = [f"{path}/{k}: only direct" for k in direct.keys() - gated.keys()]
        found += [f"{path}/{k}: only through slotgate" for k in gated.keys() - direct.keys()]
        for key in direct.keys() & gated.keys():
            if key not in LOOSE:
                found += differences(direct[key], gated[key], f"{path}/{key}")
        return found
    if isinstance(direct, list) and isinstance(gated, list):
        if len(direct) != len(gated):
            return [f"{path}: {len(direct)} items direct, {len(gated)} through slotgate"]
        return [
            d
            for i, pair in enumerate(zip(direct, gated, strict=True))
            for d in differences(*pair, f"{path}[{i}]")
        ]
    if type(direct) is not type(gated) or direct != gated:
        return [f"{path}: {direct!r:.80} direct, {gated!r:.80} through slotgate"]
    return []


@pytest.fixture(scope="module")
def forwarded() -> frozenset[str]:
    return FORWARDED_AS_SENT


async def test_every_option_is_in_the_matrix_or_forwarded_as_sent_and_the_docs_say_which(
    forwarded: frozenset[str],
) -> None:
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    for name in forwarded:
        assert f"`{name}`" in page
    assert "__verbose" in page


@pytest.mark.parametrize(("route", "name"), CASES)
async def test_an_assembled_answer_equals_llama_servers_own(
    engine: LocalEngine,
    start_gate: GateFactory,
    client: httpx.AsyncClient,
    route: str,
    name: str,
) -> None:
    gate = await start_gate(max_queue=4)
    # The first non-streamed chat goes as sent: it shows llama-server adds no __verbose.
    warm = await client.post(gate.url + CHAT, json=request(CHAT, "plain"))
    assert warm.status_code == 200
    body = request(route, name)
    direct = await client.post(engine.url + route, json=body)
    gated = await client.post(gate.url + route, json=body)
    assert gated.status_code == direct.status_code, gated.text
    found = differences(direct.json(), gated.json())
    assert found == [], found
    names = {k for k in direct.headers if k not in HEADERS_LOOSE}
    assert names == {k for k in gated.headers if k not in HEADERS_LOOSE}
    for header in names:
        assert gated.headers[header] == direct.headers[header], header


# -- __verbose: llama.cpp's own suite reads it from a server started with --verbose -------------

#: llama.cpp started as `llama-server --verbose` starts it: xllamacpp's verbosity above 9 (the
#: server's `params_base.verbosity > 9`). It ends when its stdin closes, as slotgate's engines do.
_VERBOSE_HOST = """
import os, sys, threading, xllamacpp
p = xllamacpp.CommonParams()
p.model.path = sys.argv[1]
p.port = int(sys.argv[2])
p.hostnames = ["127.0.0.1"]
p.n_parallel, p.n_ctx = 1, 512
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
p.verbosity = 100
server = xllamacpp.Server(p)
sys.stdin.buffer.read()
os._exit(0)
"""
BOOK = {
    "max_tokens": 2,
    "messages": [
        {"role": "system", "content": "Book"},
        {"role": "user", "content": "What is the best book"},
    ],
}


@pytest.fixture(scope="module")
def verbose_url() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", _VERBOSE_HOST, str(demo_model()), str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=5) as probe:
            deadline = time.monotonic() + 120
            while not _healthy(probe, url):
                assert process.poll() is None, "the verbose engine exited"
                assert time.monotonic() < deadline, "the verbose engine did not start"
                time.sleep(0.2)
        yield url
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _healthy(probe: httpx.Client, url: str) -> bool:
    try:
        return probe.get(url + "/health").status_code == 200
    except httpx.TransportError:
        return False


async def test_a_verbose_llama_servers_first_non_streamed_chat_through_slotgate_has_verbose(
    verbose_url: str, client: httpx.AsyncClient
) -> None:
    settings = Settings(
        _env_file=None, llama_server_url=verbose_url, keepalive_interval_s=0, log_level="warning"
    )
    gate = await serve(settings)
    try:
        await eventually(lambda: gate.service.upstream.ready, timeout_s=10)
        # As llama.cpp's test_chat_template and test_chat_template_assistant_prefill read it.
        for _ in range(2):
            answer = await client.post(gate.url + "/chat/completions", json=BOOK)
            assert answer.status_code == 200
            assert "Book" in answer.json()["__verbose"]["prompt"]
    finally:
        await gate.stop()


async def test_a_quiet_llama_server_honours_a_bodys_verbose_and_still_gets_assembled_answers(
    start_gate: GateFactory, llama: Llama, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    # As llama.cpp's test_verbose_debug reads it, from the first answer on.
    for verbose in (True, False):
        answer = await client.post(
            gate.url + "/chat/completions", json={**BOOK, "verbose": verbose}
        )
        assert answer.status_code == 200
        assert ("__verbose" in answer.json()) is verbose
        if verbose:
            assert "Book" in answer.json()["__verbose"]["prompt"]
    # The first that leaves it to llama-server goes as sent and shows it adds no __verbose;
    # from then on non-streamed chats are assembled: llama.cpp ran the last one as a stream.
    for _ in range(2):
        plain = await client.post(gate.url + "/chat/completions", json=BOOK)
        assert plain.status_code == 200
        assert "__verbose" not in plain.json()
    latest = max(await llama.slots(), key=lambda slot: slot.get("id_task", -1))
    assert latest["params"]["stream"] is True
