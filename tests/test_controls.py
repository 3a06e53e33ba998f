"""The operator controls against real sockets: a drain never cuts a running request, a pause
never loses a waiter, a cancel frees the slot at once; who may use them; one log line and one
count each."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from slotgate.asgi import Message
from slotgate.controls import Operators
from slotgate.errors import Forbidden, Unauthorized
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.tenants import label
from slotgate.main import Service
from slotgate.proxy.answer import Answer
from slotgate.proxy.body_bytes import BodyBytes, HeldBody
from slotgate.proxy.request import Request
from slotgate.proxy.watch import Running, Watch
from slotgate.settings import Settings

from tests.conftest import (
    CHAT,
    GateFactory,
    GatesFor,
    MakeRouter,
    RunningGate,
    StartUpstreams,
    assert_lines,
    chat,
    hold_stream_of,
    line,
    occupy,
    slow_model,
)
from tests.support.harness import (
    SSE,
    Client,
    FakeResponse,
    FakeUpstreamClient,
    Rig,
    chat_body,
    http_scope,
)
from tests.support.router import hosted
from tests.support.standin import StandIn


async def act(
    client: httpx.AsyncClient, gate: RunningGate, path: str, key: str | None = None
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return await client.post(gate.url + "/admin/" + path, headers=headers)


async def act_with(
    client: httpx.AsyncClient, gate: RunningGate, path: str, headers: dict[str, str]
) -> httpx.Response:
    return await client.post(gate.url + "/admin/" + path, headers=headers)


def metric(action: str) -> str:
    return f'slotgate_operator_actions_total{{action="{action}"}}'


async def test_a_pause_never_loses_a_waiter_and_resume_serves_them_in_order(
    one_slot: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = await one_slot(max_queue=4)
    holder = await occupy(client, gate)
    caplog.set_level(logging.INFO, logger="slotgate.operator")
    paused = await act(client, gate, "pause")
    assert paused.status_code == 200
    assert paused.json() == {"ok": True, "paused": True}
    assert "operator 127.0.0.1 paused admission" in caplog.text
    waiters = [
        asyncio.create_task(
            client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": f"w{i}"})
        )
        for i in range(3)
    ]
    await gate.until(lambda: gate.service.admission.queued == 3)
    # The running stream finishes; its slot is handed to nobody while paused.
    standin.hurry()
    await holder
    await gate.until(lambda: gate.service.admission.active == 0)
    await asyncio.sleep(0.1)  # a hand-off would have happened in this time; none may
    view = (await client.get(gate.url + "/admission")).json()
    assert (view["paused"], view["active"], view["queued"]) == (True, 0, 3)
    assert all(not w.done() for w in waiters)
    # The line's bound still holds while paused.
    over = [asyncio.create_task(client.post(gate.url + CHAT, json=chat())) for _ in range(2)]
    done, _ = await asyncio.wait(over, return_when=asyncio.FIRST_COMPLETED)
    first = done.pop()
    refused = first.result()
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    resumed = await act(client, gate, "resume")
    assert resumed.json() == {"ok": True, "paused": False}
    answers = await asyncio.gather(*waiters, *[t for t in over if t is not first])
    assert [a.status_code for a in answers] == [200] * 4
    text = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert_lines(text, metric("pause") + " 1.0", metric("resume") + " 1.0")
    assert "slotgate_admission_paused 0.0" in text


async def test_a_drained_upstream_finishes_its_running_stream_and_gets_nothing_new(
    start_gate: GateFactory,
    standin: StandIn,
    start_upstreams: StartUpstreams,
    client: httpx.AsyncClient,
) -> None:
    other = StandIn(total_slots=1)
    await start_upstreams(other)
    standin.total_slots = 1
    standin.tokens, standin.token_delay_s = 20, 0.05
    gate = await start_gate(llama_server_url=f"{standin.url},{other.url}")
    await gate.until(lambda: all(u.ready for u in gate.service.fleet))
    started = asyncio.Event()
    # Least loaded first: with both free, which one runs it is drawn; find it after.
    chunks: list[bytes] = []
    holder = asyncio.create_task(hold_stream_of(client, gate, chat(stream=True), started))
    await started.wait()
    busy = standin if standin.running else other
    name = next(u.name for u in gate.service.fleet if u.url == busy.url)
    drained = await act(client, gate, f"upstreams/{name}/drain")
    assert drained.json() == {"ok": True, "upstream": name, "draining": True}
    view = (await client.get(gate.url + "/admission")).json()
    entry = next(u for u in view["upstreams"] if u["name"] == name)
    assert entry["draining"] is True
    assert view["capacity"] == 1  # the other's slot alone
    assert (await client.get(gate.url + "/readyz")).status_code == 200
    # New work goes to the other upstream only, even once the drained one is free.
    busy.hurry()
    chunks = await holder
    assert b"data: [DONE]" in b"".join(chunks)  # not cut: it ran to its end
    assert busy.cancelled == 0
    before = busy.started
    for _ in range(6):  # each would go to either, were the drained one not out
        assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    assert busy.started == before
    restored = await act(client, gate, f"upstreams/{name}/restore")
    assert restored.json()["draining"] is False
    assert (await client.get(gate.url + "/admission")).json()["capacity"] == 2
    unknown = await act(client, gate, "upstreams/nowhere:1/drain")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found"


async def test_draining_every_ready_upstream_makes_slotgate_not_ready(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    name = gate.service.upstream.name
    await act(client, gate, f"upstreams/{name}/drain")
    readyz = await client.get(gate.url + "/readyz")
    assert readyz.status_code == 503
    assert readyz.json()["reason"] == "every ready upstream is drained"
    await act(client, gate, f"upstreams/{name}/restore")
    assert (await client.get(gate.url + "/readyz")).status_code == 200


async def test_a_request_while_every_upstream_is_drained_waits_for_a_restore_then_hears_why(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(startup_wait_s=1.5)
    name = gate.service.upstream.name
    await act(client, gate, f"upstreams/{name}/drain")
    # Held as while llama-server starts (STARTUP_WAIT_S): a restore in that time serves it
    # (1.5 s: time for the restore's own request on a loaded machine).
    waiting = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    await act(client, gate, f"upstreams/{name}/restore")
    assert (await waiting).status_code == 200
    await act(client, gate, f"upstreams/{name}/drain")
    refused = await client.post(gate.url + CHAT, json=chat())
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "upstream_not_ready"
    assert "operator" in refused.json()["error"]["message"]  # not only "starting"


async def test_a_cancelled_waiter_leaves_the_line_with_a_final_503(
    one_slot_held: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await one_slot_held()
    waiter = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": "stuck-1"})
    )
    await gate.until(lambda: "stuck-1" in gate.service.proxy.running)
    cancelled = await act(client, gate, "requests/stuck-1/cancel")
    assert cancelled.json() == {"ok": True, "request_id": "stuck-1", "cancelled": True}
    answer = await waiter
    assert answer.status_code == 503
    assert answer.headers["x-should-retry"] == "false"
    assert "retry-after" not in answer.headers
    assert answer.json()["error"]["code"] == "cancelled_by_operator"
    assert gate.service.admission.queued == 0
    again = await act(client, gate, "requests/stuck-1/cancel")
    assert again.status_code == 404
    text = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert 'slotgate_requests_rejected_total{family="chat",reason="cancelled"} 1.0' in text
    assert 'slotgate_queue_wait_seconds_count{family="chat",outcome="cancelled"} 1.0' in text


async def test_a_cancelled_stream_frees_its_slot_at_once_and_its_upstream_stops(
    one_slot: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = await one_slot(tokens=1000)
    caplog.set_level(logging.INFO, logger="slotgate.operator")
    chunks: list[bytes] = []
    started = asyncio.Event()

    async def stream() -> None:
        async with client.stream(
            "POST", gate.url + CHAT, json=chat(stream=True), headers={"x-request-id": "long-1"}
        ) as response:
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                started.set()

    running = asyncio.create_task(stream())
    await started.wait()
    await gate.until(lambda: "long-1" in gate.service.proxy.running)
    waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat()))
    await gate.until(lambda: gate.service.admission.queued == 1)
    assert (await act(client, gate, "requests/long-1/cancel")).status_code == 200
    # The slot went to the waiter: nothing of the cancelled request holds it.
    await gate.until(lambda: gate.service.admission.queued == 0)
    await running
    body = b"".join(chunks)
    assert b'"code":"cancelled_by_operator"' in body
    assert b"[DONE]" not in body
    # llama-server saw its connection close and stopped generating.
    await gate.until(lambda: standin.cancelled == 1)
    standin.hurry()
    assert (await waiter).status_code == 200
    assert "operator 127.0.0.1 cancelled request long-1" in caplog.text


async def test_a_cancelled_non_streamed_request_gets_the_error_in_its_routes_shape(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(tokens=1000)
    body = {"model": "m", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]}
    running = asyncio.create_task(
        client.post(gate.url + "/v1/messages", json=body, headers={"x-request-id": "msg-1"})
    )
    await gate.until(lambda: standin.running == 1 and "msg-1" in gate.service.proxy.running)
    assert (await act(client, gate, "requests/msg-1/cancel")).status_code == 200
    answer = await running
    assert answer.status_code == 503
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "overloaded_error"
    assert answer.json()["error"]["code"] == "cancelled_by_operator"
    assert gate.service.admission.active == 0
    await gate.until(lambda: standin.cancelled == 1)


async def test_admin_keys_open_the_controls_and_nothing_else(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="client-key", admin_keys="ops-key")
    assert (await act(client, gate, "pause")).status_code == 401
    refused = await act(client, gate, "pause", "client-key")
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert (await act(client, gate, "pause", "ops-key")).status_code == 200
    assert gate.service.gate.paused
    assert (await act(client, gate, "resume", "ops-key")).status_code == 200
    # An admin key is no API key.
    chat_answer = await client.post(
        gate.url + CHAT, json=chat(), headers={"authorization": "Bearer ops-key"}
    )
    assert chat_answer.status_code == 401


async def test_api_keys_without_admin_keys_leave_the_controls_shut(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(api_keys="client-key")
    for key in (None, "client-key"):
        refused = await act(client, gate, "pause", key)
        assert refused.status_code == 403
        assert "ADMIN_KEYS" in refused.json()["error"]["message"]
    assert not gate.service.gate.paused


async def test_without_keys_only_loopback_clients_may_act() -> None:
    service = Service(Settings(_env_file=None))
    operators: Operators = service.operators
    assert operators.who("127.0.0.1", None) == "127.0.0.1"
    assert operators.who("::1", None) == "::1"
    with pytest.raises(Forbidden):
        operators.who("10.1.2.3", None)
    with pytest.raises(Forbidden):
        operators.who(None, None)
    keyed = Service(Settings(_env_file=None, admin_keys="ops")).operators
    assert keyed.who("10.1.2.3", b"Bearer ops") == label(b"ops")
    with pytest.raises(Unauthorized):
        keyed.who("127.0.0.1", None)


async def test_without_keys_a_page_on_another_origin_cannot_act_through_the_operators_browser(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    # A page anywhere on the web may send the browser of someone on slotgate's host to
    # http://127.0.0.1:<port>/admin/pause as a "simple" POST: no preflight, so CORS stops
    # nothing; only its reading the answer. The request arrives from loopback.
    gate = await start_gate()
    host = gate.url.removeprefix("http://")
    for headers in (
        {"origin": "https://evil.example"},
        {"origin": "http://localhost:3000"},  # another local server's page
        {"origin": "null"},  # a sandboxed frame, a file:// page
        {"sec-fetch-site": "cross-site"},
        # DNS rebinding: the page's own name resolved to 127.0.0.1; same origin, foreign name.
        {"host": "evil.example:80", "origin": "http://evil.example:80"},
        {"host": "[", "origin": "http://["},  # unparsable: refused, not a 500
    ):
        refused = await act_with(client, gate, "pause", headers)
        assert refused.status_code == 403, headers
        assert refused.json()["error"]["code"] == "forbidden"
    assert not gate.service.gate.paused
    # slotgate's own page (same origin) and curl on the host still may.
    same = await act_with(client, gate, "pause", {"origin": f"http://{host}"})
    assert same.status_code == 200
    assert (await act_with(client, gate, "resume", {"host": f"localhost:{gate.port}"})).is_success


async def test_without_keys_a_request_relayed_by_a_proxy_on_the_host_is_not_loopback(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    # A reverse proxy on the same host connects from loopback; the headers it adds say the
    # client is elsewhere.
    gate = await start_gate()
    for headers in (
        {"x-forwarded-for": "203.0.113.9"},
        {"forwarded": "for=203.0.113.9"},
        {"x-real-ip": "203.0.113.9"},
        # What Envoy (a service mesh's sidecar connects from 127.0.0.6) sets on all it relays.
        {"x-forwarded-proto": "http"},
        {"via": "1.1 proxy"},
    ):
        refused = await act_with(client, gate, "pause", headers)
        assert refused.status_code == 403, headers
        assert "ADMIN_KEYS" in refused.json()["error"]["message"]
    assert not gate.service.gate.paused
    # With ADMIN_KEYS the key decides, wherever the request came from.
    keyed = await start_gate(admin_keys="ops")
    allowed = await act_with(
        client, keyed, "pause", {"x-forwarded-for": "203.0.113.9", "authorization": "Bearer ops"}
    )
    assert allowed.status_code == 200


async def test_a_bearer_scheme_is_read_in_any_case_and_other_schemes_are_refused(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(admin_keys="ops-key,k=y/+é")
    for value in ("Bearer ops-key", "bearer ops-key", "BEARER  ops-key", "Bearer k=y/+é"):
        headers = {b"authorization": value.encode()}
        answer = await client.post(gate.url + "/admin/resume", headers=headers)
        assert answer.status_code == 200, value
    for value in ("Basic ops-key", "Bearer\tops-key", "Bearer", "ops-key", "Bearer ops-key2"):
        answer = await client.post(gate.url + "/admin/resume", headers={"authorization": value})
        assert answer.status_code == 401, value
    # An API client's header opens nothing.
    answer = await client.post(gate.url + "/admin/resume", headers={"x-api-key": "ops-key"})
    assert answer.status_code == 401


class SlowClient(Client):
    """A client whose socket takes a while to take an answer's last bytes (uvicorn's send waits
    for the socket to drain), and that can leave meanwhile."""

    async def send(self, message: Message) -> None:
        if not message.get("more_body", False) and message["type"] == "http.response.body":
            for _ in range(5):
                await asyncio.sleep(0)
        await super().send(message)


@pytest.mark.parametrize("steps_between", [0, 1, 2, 3])
async def test_a_cancel_and_the_client_leaving_at_once_end_the_request_once_and_quietly(
    steps_between: int,
) -> None:
    finish = asyncio.Event()
    held = FakeResponse(200, SSE, [b"data: 1\n\n", b"data: [DONE]\n\n"], hold=finish)
    rig = Rig(FakeUpstreamClient(held), keepalive_interval_s=0)
    client = SlowClient(chat_body(stream=True))
    scope = http_scope("POST", CHAT, [(b"x-request-id", b"both-1")])
    calling = asyncio.ensure_future(rig.proxy(scope, client.receive, client.send))
    while "both-1" not in rig.proxy.running:
        await asyncio.sleep(0.001)
    # The client's leaving is seen a few loop steps before or after the operator's cancel.
    client.gone.set()
    for _ in range(steps_between):
        await asyncio.sleep(0)
    cancelled = rig.proxy.running.cancel("both-1")  # False once the leaving was seen
    # It ends as any request does: no CancelledError out of the app (uvicorn would log it as
    # an exception), nor a shutdown it was not; as cancelled if the operator was first.
    await calling
    assert rig.admission.active == 0
    assert "both-1" not in rig.proxy.running
    assert b"shutting_down" not in client.body
    reason = "cancelled" if cancelled else "client_gone"
    assert_lines(
        rig.metrics.render().decode(),
        f'slotgate_requests_rejected_total{{family="chat",reason="{reason}"}} 1.0',
    )


async def stream_until_cancelled(
    client: httpx.AsyncClient,
    gate: RunningGate,
    path: str,
    body: dict[str, Any],
    request_id: str,
    cancel: bool = True,
) -> bytes:
    """Open a stream as `request_id`, cancel it once its first bytes are in (unless `cancel`
    is False: someone else will), read it to its end."""
    chunks: list[bytes] = []
    async with client.stream(
        "POST", gate.url + path, json=body, headers={"x-request-id": request_id}
    ) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_raw():
            if not chunks and cancel:
                await gate.until(lambda: request_id in gate.service.proxy.running)
                assert (await act(client, gate, f"requests/{request_id}/cancel")).is_success
            chunks.append(chunk)
    return b"".join(chunks)


async def test_a_cancelled_anthropic_stream_ends_with_an_error_event_in_its_shape(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await one_slot(tokens=1000)
    body = {
        "model": "m", "max_tokens": 1000, "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }  # fmt: skip
    got = await stream_until_cancelled(client, gate, "/v1/messages", body, "msg-s1")
    last = got.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    event, data = last.split(b"\n")
    assert event == b"event: error"
    error = orjson.loads(data.removeprefix(b"data: "))
    assert error["type"] == "error"
    assert error["error"]["type"] == "overloaded_error"
    assert gate.service.admission.active == 0
    await gate.until(lambda: standin.cancelled == 1)


async def test_a_cancelled_stream_still_waiting_after_its_head_ends_with_the_error_event(
    one_slot_held: GateFactory, client: httpx.AsyncClient
) -> None:
    # Its head and keep-alive comments went out while it waited: the error comes in-stream.
    gate = await one_slot_held(stream_head_after_s=0.05, keepalive_interval_s=0.05)
    got = await stream_until_cancelled(client, gate, CHAT, chat(stream=True), "wait-s1")
    assert got.startswith(b":")
    last = got.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    error = orjson.loads(last.removeprefix(b"data: "))
    assert error["error"]["code"] == "cancelled_by_operator"
    assert gate.service.admission.queued == 0


async def test_an_admin_key_that_is_also_a_tenants_key_in_the_keys_file_opens_no_control(
    start_gate: GateFactory, client: httpx.AsyncClient, keys_file: Path
) -> None:
    # API_KEYS_FILE is read (and reloaded on SIGHUP) apart from the settings' check: a key
    # found there is a client's, whoever also lists it as an operator's.
    gate = await start_gate(api_keys_file=keys_file, admin_keys="sk-chat,ops-key")
    refused = await act(client, gate, "pause", "sk-chat")
    assert refused.status_code == 403
    assert "API" in refused.json()["error"]["message"]
    assert not gate.service.gate.paused
    assert (await act(client, gate, "pause", "ops-key")).status_code == 200


async def test_a_request_id_reused_by_a_shorter_request_still_names_the_longer_one_after(
    one_slot: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    # A client sends its long generation as X, then another request as X that ends first: the
    # long one must not become one no operator can cancel.
    gate = await one_slot(tokens=1000)
    running = gate.service.proxy.running
    long = asyncio.create_task(
        stream_until_cancelled(client, gate, CHAT, chat(stream=True), "reused-1", cancel=False)
    )
    await gate.until(lambda: "reused-1" in running and standin.running == 1)
    first = running["reused-1"]
    short = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(), headers={"x-request-id": "reused-1"})
    )
    await gate.until(lambda: running.get("reused-1") not in (None, first))
    short.cancel()  # it leaves the line, and with it the registry
    await asyncio.gather(short, return_exceptions=True)
    await gate.until(lambda: gate.service.admission.queued == 0)
    assert (await act(client, gate, "requests/reused-1/cancel")).status_code == 200
    body = await long
    assert b'"code":"cancelled_by_operator"' in body
    assert "reused-1" not in running
    assert not running.older


def a_watch() -> Watch:
    """A request's watch, as the registry holds it (never started: only its identity counts)."""
    held = HeldBody(BodyBytes(0, Admission(QueuePolicy(), capacity=1)))
    request = Request(http_scope("POST", CHAT), held)

    async def send(message: Message) -> None:
        pass

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    return Watch(receive, request, Answer(send), lambda request: [])


async def test_the_registry_keeps_only_live_requests_under_a_reused_id_in_any_order_of_ending() -> (
    None
):
    running = Running()
    a, b, c = (a_watch() for _ in range(3))
    for watch in (a, b, c):
        running.enlist("x", watch)
    assert running["x"] is c
    running.delist("x", b)  # one in the middle ends first
    running.delist("x", c)
    assert running["x"] is a
    running.delist("x", a)
    assert "x" not in running
    assert not running.older


async def test_the_registry_walks_every_live_request_in_coming_order_reused_ids_too() -> None:
    running = Running()
    a, b, c, d = (a_watch() for _ in range(4))
    running.enlist("x", a)
    running.enlist("y", b)
    running.enlist("x", c)  # the same id again: listed under it, after the first
    running.enlist("z", d)
    assert list(running.watches()) == [a, c, b, d]
    running.delist("x", a)
    assert list(running.watches()) == [c, b, d]


# -- with one line per model (a llama-server router) -------------------------------------------


async def test_a_pause_holds_every_models_line_and_resume_serves_it(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(1)})
    gate = await gate_before(upstream)
    assert (await act(client, gate, "pause")).status_code == 200
    waiters = [
        asyncio.create_task(client.post(gate.url + CHAT, json=chat(model=model)))
        for model in ("alpha", "beta")
    ]
    alpha, beta = line(gate, "alpha"), line(gate, "beta")
    await gate.until(lambda: alpha.admission.queued == 1 and beta.admission.queued == 1)
    await asyncio.sleep(0.1)  # a grant would have happened in this time; none may
    assert (alpha.admission.active, beta.admission.active) == (0, 0)
    assert not any(w.done() for w in waiters)
    assert (await act(client, gate, "resume")).status_code == 200
    assert [(await w).status_code for w in waiters] == [200, 200]


async def test_draining_a_router_drains_every_models_pool_and_says_so(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2), "beta": hosted(1, "unloaded")})
    gate = await gate_before(upstream)
    alpha = line(gate, "alpha")
    await gate.until(lambda: alpha.admission.capacity == 2)
    name, url = gate.service.upstream.name, gate.service.upstream.url
    assert (await act(client, gate, f"upstreams/{name}/drain")).status_code == 200
    view = (await client.get(gate.url + "/admission")).json()
    assert view["upstreams"][0]["draining"] is True
    models = {m["model"]: m for m in view["models"]}
    assert [p["draining"] for p in models["alpha"]["pools"]] == [True]
    assert models["alpha"]["capacity"] is None  # its slots left with its router
    text = (await client.get(gate.url + "/metrics?source=slotgate")).text
    assert f'slotgate_upstream_draining{{upstream="{url}"}} 1.0' in text
    readyz = await client.get(gate.url + "/readyz")
    assert readyz.status_code == 503
    assert readyz.json()["reason"] == "every ready upstream is drained"
    # Both wait: alpha for its slots back, beta too, and nothing is loaded on a drained router.
    waiters = [
        asyncio.create_task(client.post(gate.url + CHAT, json=chat(model=model)))
        for model in ("alpha", "beta")
    ]
    beta = line(gate, "beta")
    await gate.until(lambda: alpha.admission.queued == 1 and beta.admission.queued == 1)
    await refreshed(gate, 2)
    assert upstream.routing is not None
    assert upstream.routing.loads == 0
    assert (await act(client, gate, f"upstreams/{name}/restore")).status_code == 200
    assert [(await w).status_code for w in waiters] == [200, 200]
    assert (await client.get(gate.url + "/readyz")).status_code == 200


async def test_a_request_in_a_models_line_is_cancelled_waiting_or_running(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream, child = await slow_model(router)
    gate = await gate_before(upstream)
    started = asyncio.Event()
    body, headers = chat(model="alpha", stream=True), {"x-request-id": "run-1"}
    running = asyncio.create_task(hold_stream_of(client, gate, body, started, headers))
    await started.wait()
    alpha = line(gate, "alpha")
    waiter = asyncio.create_task(
        client.post(gate.url + CHAT, json=chat(model="alpha"), headers={"x-request-id": "wait-1"})
    )
    await gate.until(lambda: alpha.admission.queued == 1)
    assert (await act(client, gate, "requests/wait-1/cancel")).status_code == 200
    answer = await waiter
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "cancelled_by_operator"
    assert alpha.admission.queued == 0
    assert (await act(client, gate, "requests/run-1/cancel")).status_code == 200
    assert b'"code":"cancelled_by_operator"' in b"".join(await running)
    assert alpha.admission.active == 0
    await gate.until(lambda: child.cancelled == 1)


async def test_a_paused_gate_loads_no_model_for_a_waiting_line(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(2, "unloaded")})
    gate = await gate_before(upstream)
    await act(client, gate, "pause")
    waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat(model="alpha")))
    alpha = line(gate, "alpha")
    await gate.until(lambda: alpha.admission.queued == 1)
    await refreshed(gate, 2)
    assert upstream.routing is not None
    assert upstream.routing.loads == 0
    await act(client, gate, "resume")
    assert (await waiter).status_code == 200
    assert upstream.routing.loads == 1


async def refreshed(gate: RunningGate, times: int) -> None:
    """Until the router's follower has read it `times` more times (each would plan loads)."""
    router = gate.service.upstream.router
    assert router is not None
    seen = 0
    refresh = router.refresh

    async def counted(props: dict[str, Any]) -> None:
        nonlocal seen
        await refresh(props)
        seen += 1

    router.refresh = counted  # type: ignore[method-assign]
    try:
        await gate.until(lambda: seen >= times)
    finally:
        router.refresh = refresh  # type: ignore[method-assign]


async def test_a_drained_server_of_one_model_beside_a_router_is_drained_in_its_models_line(
    router: MakeRouter,
    gates_for: GatesFor,
    start_upstreams: StartUpstreams,
    client: httpx.AsyncClient,
) -> None:
    small = StandIn(total_slots=1, tokens=3, token_delay_s=0.01, model="small.gguf")
    await start_upstreams(small)
    routed = await router({"routed": hosted(1)})
    gate = await gates_for([small, routed], startup_wait_s=10)
    await gate.until(
        lambda: (lane := gate.service.models.find("small.gguf")) is not None and lane.running
    )
    small_line = line(gate, "small.gguf")
    name = next(u.name for u in gate.service.fleet if u.url == small.url)
    assert (await act(client, gate, f"upstreams/{name}/drain")).status_code == 200
    assert small_line.admission.capacity is None
    assert [pool.draining for pool in small_line.admission.pools] == [True]
    # The router still serves its own model; the drained server's model waits for it.
    assert (await client.post(gate.url + CHAT, json=chat(model="routed"))).status_code == 200
    waiter = asyncio.create_task(client.post(gate.url + CHAT, json=chat(model="small.gguf")))
    await gate.until(lambda: small_line.admission.queued == 1)
    assert (await client.get(gate.url + "/readyz")).status_code == 200
    assert (await act(client, gate, f"upstreams/{name}/restore")).status_code == 200
    assert (await waiter).status_code == 200
    assert small.finished == 1


async def test_a_model_a_drained_router_lists_later_starts_drained(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(1)})
    gate = await gate_before(upstream)
    name = gate.service.upstream.name
    await act(client, gate, f"upstreams/{name}/drain")
    assert upstream.hosted is not None
    upstream.hosted["beta"] = hosted(2)
    await gate.until(lambda: gate.service.models.find("beta") is not None)
    beta = line(gate, "beta")
    await refreshed(gate, 2)
    assert beta.admission.capacity is None
    assert [pool.draining for pool in beta.admission.pools] == [True]
    await act(client, gate, f"upstreams/{name}/restore")
    await gate.until(lambda: beta.admission.capacity == 2)
