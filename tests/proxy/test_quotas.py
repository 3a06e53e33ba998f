"""Quotas per tenant through the whole gate, in front of the stand-in: the rate-limit headers,
the 429, the tokens read from llama-server's usage, reloads, and the OpenAI SDK reading them."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from slotgate.gate.quotas import MINUTE_S
from slotgate.proxy.quota import Tally, duration

from tests.conftest import (
    CHAT,
    GateFactory,
    GatesFor,
    MakeRouter,
    RunningGate,
    chat,
    write_keys,
)
from tests.support.clock import T0, Clock
from tests.support.router import hosted
from tests.support.standin import StandIn


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def quota_gate(
    start_gate: GateFactory, tmp_path: Path, limits: str, clock: Clock | None = None
) -> RunningGate:
    """A gate whose tenant `chat` (key sk-chat) has `limits`; `free` (sk-free) has none."""
    keys = write_keys(
        tmp_path, f'[tenants.chat]\nkey = "sk-chat"\n{limits}\n[tenants.free]\nkey = "sk-free"\n'
    )
    gate: RunningGate = await start_gate(api_keys_file=keys)
    gate.service.quotas.clock = clock or Clock()
    return gate


def rate_headers(answer: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in answer.headers.items() if k.startswith("x-ratelimit-")}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_every_answer_of_a_tenant_with_quotas_carries_the_rate_limit_headers(
    start_gate: GateFactory, client: httpx.AsyncClient, tmp_path: Path, stream: bool
) -> None:
    gate = await quota_gate(
        start_gate, tmp_path, "requests_per_minute = 5\ntokens_per_minute = 1000"
    )
    answer = await client.post(gate.url + CHAT, json=chat(stream), headers=bearer("sk-chat"))
    assert answer.status_code == 200
    assert rate_headers(answer) == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-reset-requests": "50s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "50s",
    }
    free = await client.post(gate.url + CHAT, json=chat(stream), headers=bearer("sk-free"))
    assert free.status_code == 200
    assert rate_headers(free) == {}


async def test_a_request_past_its_quota_gets_a_429_naming_the_limit_with_retry_after(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    gate = await quota_gate(start_gate, tmp_path, "requests_per_minute = 1")
    await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-chat"))
    seen = len(standin.seen)
    answer = await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-chat"))
    assert answer.status_code == 429
    assert answer.headers["retry-after"] == "50"
    assert answer.headers["retry-after-ms"] == "50000"
    assert rate_headers(answer)["x-ratelimit-remaining-requests"] == "0"
    error = answer.json()["error"]
    assert (error["code"], error["type"], error["quota"]) == (
        "quota_exceeded", "rate_limit_error", "requests_per_minute",
    )  # fmt: skip
    assert "requests_per_minute" in error["message"]
    assert len(standin.seen) == seen  # it never reached llama-server
    # Another tenant is not held back.
    free = await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-free"))
    assert free.status_code == 200
    metrics = (await client.get(gate.url + "/metrics", headers=bearer("sk-chat"))).text
    assert 'family="chat",reason="quota_exceeded",tenant="chat"} 1.0' in metrics


async def test_a_quota_refusal_on_the_messages_route_is_in_anthropics_shape(
    start_gate: GateFactory, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    gate = await quota_gate(start_gate, tmp_path, "requests_per_minute = 1")
    body: dict[str, Any] = {
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
    }  # fmt: skip
    await client.post(gate.url + "/v1/messages", json=body, headers=bearer("sk-chat"))
    answer = await client.post(gate.url + "/v1/messages", json=body, headers=bearer("sk-chat"))
    assert answer.status_code == 429
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "rate_limit_error"
    assert answer.json()["error"]["code"] == "quota_exceeded"


@pytest.mark.parametrize(
    ("stream", "extra", "per_answer"),
    [
        (False, {}, 13),  # usage: 3 prompt + 10 completion tokens
        (True, {}, 10),  # no usage asked for: the timings' predicted_n
        (True, {"stream_options": {"include_usage": True}}, 13),
    ],
    ids=["json-usage", "stream-timings", "stream-usage"],
)
async def test_a_tenant_at_its_tokens_per_minute_is_refused_within_one_answer_of_the_limit(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    tmp_path: Path,
    stream: bool,
    extra: dict[str, Any],
    per_answer: int,
) -> None:
    standin.tokens = 10
    gate = await quota_gate(start_gate, tmp_path, "tokens_per_minute = 50")
    served = 0
    while True:
        answer = await client.post(
            gate.url + CHAT, json=chat(stream, **extra), headers=bearer("sk-chat")
        )
        if answer.status_code == 429:
            break
        assert answer.status_code == 200
        served += 1
    assert answer.json()["error"]["quota"] == "tokens_per_minute"
    used = gate.service.quotas.account("chat").minute_tokens
    assert used == served * per_answer
    # Let in while below the limit, so it ends at or past it by less than one answer.
    assert 50 <= used < 50 + per_answer
    assert served == math.ceil(50 / per_answer)


async def test_a_stream_cut_before_its_usage_is_charged_its_events(
    start_gate: GateFactory, standin: StandIn, tmp_path: Path
) -> None:
    standin.tokens, standin.token_delay_s = 200, 0.01
    gate = await quota_gate(start_gate, tmp_path, "tokens_per_day = 100000")
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", gate.url + CHAT, json=chat(True), headers=bearer("sk-chat")) as r,
    ):
        async for line in r.aiter_lines():
            if line.startswith("data: ") and "t4 " in line:
                break
    await gate.until(lambda: gate.service.quotas.account("chat").day_tokens > 0)
    used = gate.service.quotas.account("chat").day_tokens
    assert 5 <= used < 200


async def test_a_reload_keeps_the_windows_and_puts_new_limits_in_force(
    start_gate: GateFactory, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    gate = await quota_gate(start_gate, tmp_path, "requests_per_minute = 2")
    for _ in range(2):
        await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-chat"))
    keys = tmp_path / "keys.toml"
    keys.write_text(keys.read_text().replace("requests_per_minute = 2", "weight = 2\n"
                                             "requests_per_minute = 2"))  # fmt: skip
    assert gate.service.access.tenants.reload()
    answer = await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-chat"))
    assert answer.status_code == 429  # the minute's two requests are still counted
    keys.write_text(keys.read_text().replace("requests_per_minute = 2", "requests_per_minute = 4"))
    assert gate.service.access.tenants.reload()
    answer = await client.post(gate.url + CHAT, json=chat(), headers=bearer("sk-chat"))
    assert answer.status_code == 200
    assert rate_headers(answer)["x-ratelimit-remaining-requests"] == "1"


async def test_the_openai_sdk_reads_the_headers_and_retries_only_after_retry_after(
    start_gate: GateFactory, tmp_path: Path
) -> None:
    # 1.5 s before the minute ends; the clock moves on when the SDK comes back, so that what
    # is measured is the SDK's own wait, not the machine's speed.
    minute_end = (T0 // MINUTE_S + 1) * MINUTE_S
    clock = Clock(minute_end - 1.5)
    gate = await quota_gate(start_gate, tmp_path, "requests_per_minute = 1", clock)
    sent: list[float] = []

    async def seen(request: Any) -> None:
        sent.append(time.monotonic())
        if len(sent) > 2:
            clock.now = minute_end + 0.5

    hooks = {"request": [seen]}
    async with (
        openai.DefaultAsyncHttpxClient(event_hooks=hooks) as http,
        openai.AsyncOpenAI(
            base_url=gate.url + "/v1", api_key="sk-chat", http_client=http, max_retries=2
        ) as sdk,
    ):
        raw = await sdk.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.headers["x-ratelimit-limit-requests"] == "1"
        assert raw.headers["x-ratelimit-remaining-requests"] == "0"
        assert raw.headers["x-ratelimit-reset-requests"] == "1.5s"
        # Refused once (Retry-After 1.5 s), then retried by the SDK and served.
        again = await sdk.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert again.headers["x-ratelimit-remaining-requests"] == "0"
        assert again.parse().choices[0].message.content
    assert len(sent) == 3
    assert sent[2] - sent[1] >= 1.5 - 0.01


async def test_the_openai_sdk_does_not_retry_a_day_quota(
    start_gate: GateFactory, standin: StandIn, tmp_path: Path
) -> None:
    gate = await quota_gate(start_gate, tmp_path, "tokens_per_day = 5")
    sent: list[Any] = []

    async def seen(request: Any) -> None:
        sent.append(request)

    async with (
        openai.DefaultAsyncHttpxClient(event_hooks={"request": [seen]}) as http,
        openai.AsyncOpenAI(
            base_url=gate.url + "/v1", api_key="sk-chat", http_client=http, max_retries=2
        ) as sdk,
    ):
        await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        with pytest.raises(openai.RateLimitError) as refused:
            await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "b"}]
            )
    # Retry-After is the rest of the day, past what the SDK waits for: it gives up at once.
    assert int(refused.value.response.headers["retry-after"]) > 120
    assert refused.value.code == "quota_exceeded"
    assert len(sent) == 2


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.02, "20ms"), (0.9996, "1s"), (1.5, "1.5s"), (6, "6s"), (62, "1m2s"), (360, "6m0s"),
     (3723.25, "1h2m3.25s"), (86400, "24h0m0s")],
)  # fmt: skip
def test_a_reset_is_written_as_openai_writes_durations(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_an_anthropic_streams_prompt_tokens_are_read_from_its_first_event() -> None:
    charged: list[int] = []

    class Ledger:
        async def admit(self, name: str, quota: Any) -> Any:
            raise NotImplementedError

        def charge(self, name: str, tokens: int) -> None:
            charged.append(tokens)

        async def aclose(self) -> None:
            return

    tally = Tally(Ledger(), "chat")
    tally.feed(
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":21,"output_tokens":0}}}\n\n'
    )
    for _ in range(200):
        tally.feed(
            b'event: content_block_delta\ndata: {"delta":{"text":"\\"output_tokens\\""}}\n\n'
        )
    tally.feed(
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":7}}\n\n'
    )
    tally.settle()
    assert charged == [28]


async def test_a_tenants_quota_counts_its_requests_for_every_model_in_one_window(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    keys = write_keys(
        tmp_path,
        '[tenants.chat]\nkey = "sk-chat"\nrequests_per_minute = 3\ntokens_per_day = 1000\n'
        '[tenants.free]\nkey = "sk-free"\n',
    )
    upstream = await router({"alpha": hosted(2), "beta": hosted(2)})
    gate = await gate_before(upstream, api_keys_file=keys)
    gate.service.quotas.clock = Clock()
    left = []
    for model in ("alpha", "beta", "alpha"):
        answer = await client.post(
            gate.url + CHAT, json=chat(model=model), headers=bearer("sk-chat")
        )
        assert answer.status_code == 200
        left.append(answer.headers["x-ratelimit-remaining-requests"])
    assert left == ["2", "1", "0"]
    refused = await client.post(gate.url + CHAT, json=chat(model="beta"), headers=bearer("sk-chat"))
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "quota_exceeded"
    view = (await client.get(gate.url + "/admission", headers=bearer("sk-chat"))).json()
    tenants = {t["name"]: t for t in view["tenants"]}
    assert "quota" not in tenants["free"]
    quota = tenants["chat"]["quota"]
    assert quota["requests_per_minute"] == {
        "limit": 3, "used": 3, "remaining": 0, "reset_s": 50.0,
    }  # fmt: skip
    day = quota["tokens_per_day"]
    # Three answers' prompts and completions, whichever model gave them.
    assert day["used"] > 0
    assert day["used"] + day["remaining"] == day["limit"] == 1000
    assert "tokens_per_minute" not in quota


class Charges:
    """A ledger that records what is charged."""

    def __init__(self) -> None:
        self.charged: list[int] = []

    async def admit(self, name: str, quota: Any) -> Any:
        raise NotImplementedError

    def charge(self, name: str, tokens: int) -> None:
        self.charged.append(tokens)

    async def aclose(self) -> None:
        return


@pytest.mark.parametrize(
    "body",
    [
        # llama-server's /v1/embeddings and /v1/rerank: a usage with no completion tokens.
        b'{"data":[{"embedding":[0.1,0.2],"index":0,"object":"embedding"}],"model":"m",'
        b'"object":"list","usage":{"prompt_tokens":42,"total_tokens":42}}',
        b'{"model":"m","object":"list","results":[{"index":0,"relevance_score":0.5}],'
        b'"usage":{"prompt_tokens":42,"total_tokens":42}}',
    ],
    ids=["embeddings", "rerank"],
)
def test_an_answer_with_only_prompt_tokens_is_charged_them(body: bytes) -> None:
    ledger = Charges()
    tally = Tally(ledger, "chat")
    tally.feed(body)
    tally.settle()
    # Not nothing: embeddings would otherwise pass tokens_per_minute and tokens_per_day free.
    assert ledger.charged == [42]


def test_an_anthropic_stream_cut_before_its_end_is_charged_its_prompt_and_events() -> None:
    # Its first event's usage ("output_tokens":0) is a placeholder, not the count: a stream
    # cut before message_delta was charged its prompt alone, whatever it had generated.
    ledger = Charges()
    tally = Tally(ledger, "chat")
    tally.feed(
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":21,"output_tokens":0}}}\n\n'
    )
    for _ in range(30):
        tally.feed(b'event: content_block_delta\ndata: {"delta":{"text":"x"}}\n\n')
    tally.settle()
    assert ledger.charged == [21 + 31]  # its prompt; one per event relayed, as documented


def test_a_native_answer_whose_timings_precede_long_probabilities_is_charged_them() -> None:
    # llama-server's /completion puts completion_probabilities (n_probs) after its timings:
    # they pushed the timings out of the kept tail, and the answer was charged nothing.
    probs = b",".join(
        b'{"id":1,"token":"x","bytes":[120],"prob":0.5,"top_probs":[]}' for _ in range(400)
    )
    body = (
        b'{"index":0,"content":"' + b"x" * 400 + b'","tokens":[],"stop":true,'
        b'"tokens_predicted":400,"tokens_evaluated":12,"timings":{"cache_n":0,"prompt_n":12,'
        b'"predicted_n":400},"completion_probabilities":[' + probs + b"]}"
    )
    for chunked in (False, True):
        ledger = Charges()
        tally = Tally(ledger, "chat")
        for at in range(0, len(body), 1000 if chunked else len(body)):
            tally.feed(body[at : at + (1000 if chunked else len(body))])
        tally.settle()
        assert ledger.charged == [412], chunked
