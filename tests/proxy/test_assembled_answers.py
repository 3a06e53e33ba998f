"""What llama-server says survives slotgate: its headers where slotgate merges or assembles,
and a bound on what an assembled answer may hold."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import slotgate.proxy.modes

from tests.conftest import CHAT, GateFactory, StartUpstreams, chat
from tests.support.standin import StandIn


async def test_merged_metrics_keep_llama_servers_process_start_time_header(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    response = await client.get(gate.url + "/metrics")
    assert response.status_code == 200
    assert "llamacpp:requests_processing" in response.text
    assert response.headers["process-start-time-unix"] == str(standin.created)


async def test_an_assembled_answer_keeps_llama_servers_own_headers(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    await client.post(gate.url + CHAT, json=chat())  # shows llama-server adds no __verbose
    origin = {"Origin": "http://app.example"}
    response = await client.post(gate.url + CHAT, json=chat(), headers=origin)
    assert response.status_code == 200
    assert b'"stream":true' in standin.seen[-1].body  # asked upstream as a stream
    assert response.headers["access-control-allow-origin"] == "http://app.example"
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    assert "x-accel-buffering" not in response.headers
    assert response.json()["usage"]["completion_tokens"] == standin.tokens


async def test_an_assembled_answer_past_its_bound_is_cut_with_a_502_in_the_api_shape(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(slotgate.proxy.modes, "MAX_ASSEMBLED_BYTES", 64 * 1024)
    gate = await start_gate()
    await client.post(gate.url + CHAT, json=chat())  # shows llama-server adds no __verbose
    standin.tokens, standin.token_delay_s, standin.padding = 500, 0.0, 1024
    response = await client.post(gate.url + CHAT, json=chat())
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_failed"
    assert "stream" in error["message"]
    await gate.until(lambda: gate.service.admission.active == 0)


@pytest.mark.parametrize(
    ("verbose", "assembled", "verbose_object"),
    [
        # llama-server --verbose: each answer is sent as asked, and carries llama-server's own
        # verbose object.
        pytest.param(True, [False, False], {"stream": False}, id="verbose-as-sent"),
        # The first is sent as asked, and teaches that llama-server adds no verbose object;
        # from then on non-streamed answers are assembled.
        pytest.param(False, [False, True], None, id="quiet-then-assembled"),
    ],
)
async def test_non_streamed_answers_are_assembled_once_one_showed_llama_server_adds_no_verbose(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    verbose: bool,
    assembled: list[bool],
    verbose_object: dict[str, Any] | None,
) -> None:
    standin.verbose = verbose
    gate = await start_gate()
    for streamed_upstream in assembled:
        answer = await client.post(gate.url + CHAT, json=chat())
        assert answer.status_code == 200
        assert (b'"stream":true' in standin.seen[-1].body) is streamed_upstream
        if verbose_object is None:
            assert "__verbose" not in answer.json()
        else:
            assert answer.json()["__verbose"] == verbose_object


async def test_a_body_that_sets_verbose_decides_whether_its_answer_is_assembled(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    gate = await start_gate()
    assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200  # it teaches
    await client.post(gate.url + CHAT, json=chat(verbose=True))
    # llama-server adds __verbose for a body asking for it, whatever its own setting.
    assert b'"stream":true' not in standin.seen[-1].body
    standin.verbose = True
    await client.post(gate.url + CHAT, json=chat())  # the stream shows it: now verbose
    await client.post(gate.url + CHAT, json=chat(verbose=False))
    # ... and leaves it out for a body that declines it.
    assert b'"stream":true' in standin.seen[-1].body


async def test_a_llama_server_restarted_with_verbose_has_its_first_answer_carry_it(
    start_gate: GateFactory,
    standin: StandIn,
    client: httpx.AsyncClient,
    start_upstreams: StartUpstreams,
) -> None:
    gate = await start_gate(startup_wait_s=0)
    for _ in range(2):  # the first shows it adds no __verbose; the second is assembled
        assert (await client.post(gate.url + CHAT, json=chat())).status_code == 200
    assert b'"stream":true' in standin.seen[-1].body
    await standin.stop()
    await gate.until(lambda: not gate.service.upstream.ready)
    restarted = StandIn(port=standin.port, verbose=True)
    await start_upstreams(restarted)
    await gate.until(lambda: gate.service.upstream.ready)
    answer = await client.post(gate.url + CHAT, json=chat())
    assert answer.status_code == 200
    assert answer.json()["__verbose"] == {"stream": False}
