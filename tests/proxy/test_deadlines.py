"""Deadlines per request through the whole gate, in front of the stand-in: X-Max-Wait and a
tenant's max_wait_s, refused at once or leaving the line at the bound, never reaching
llama-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import (
    CHAT,
    GateFactory,
    GatesFor,
    MakeRouter,
    RunningGate,
    cancel_all,
    chat,
    write_keys,
)
from tests.support.router import children, hosted
from tests.support.standin import StandIn


@pytest.fixture
async def busy(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient, tmp_path: Path
) -> AsyncIterator[RunningGate]:
    """A gate in front of one slot that a long generation holds (the hold clock having seen
    one short one), whose tenant `patient` (sk-patient) has max_wait_s = 0."""
    keys = write_keys(tmp_path, '[tenants.patient]\nkey = "sk-patient"\nmax_wait_s = 0\n')
    standin.total_slots, standin.tokens = 1, 1
    gate: RunningGate = await start_gate(api_keys_file=keys)
    await post(client, gate)  # a real hold, to estimate by
    standin.tokens, standin.token_delay_s = 1000, 0.05
    holder = asyncio.create_task(post(client, gate))
    await gate.until(lambda: gate.service.admission.active == 1)
    try:
        yield gate
    finally:
        standin.hurry()
        await cancel_all([holder])


async def post(client: httpx.AsyncClient, gate: RunningGate, **headers: str) -> httpx.Response:
    headers.setdefault("authorization", "Bearer sk-patient")
    return await client.post(gate.url + CHAT, json=chat(), headers=headers)


async def test_a_request_whose_expected_wait_exceeds_its_bound_is_refused_at_once(
    busy: RunningGate, client: httpx.AsyncClient, standin: StandIn
) -> None:
    seen = len(standin.seen)
    answer = await post(client, busy, **{"x-max-wait": "0"})
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "deadline_unmet"
    assert error["max_wait_s"] == 0
    assert error["eta_s"] > 0
    assert int(answer.headers["retry-after"]) >= 1
    assert busy.service.admission.queued == 0
    assert len(standin.seen) == seen


async def test_a_request_still_waiting_at_its_bound_leaves_the_line(
    busy: RunningGate, client: httpx.AsyncClient, standin: StandIn
) -> None:
    # Its estimate (half what the holder has run, the average hold being short) is within
    # 5 s; the holder runs for 50 s.
    answer = await post(client, busy, **{"x-max-wait": "5"})
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["code"] == "deadline_unmet"
    assert "no slot became free" in error["message"]
    assert busy.service.admission.queued == 0
    assert busy.service.admission.active == 1


async def test_a_tenants_bound_holds_unless_the_request_gives_its_own(
    busy: RunningGate, client: httpx.AsyncClient, standin: StandIn
) -> None:
    refused = await post(client, busy)
    assert refused.status_code == 503
    assert refused.json()["error"]["max_wait_s"] == 0
    waiting = asyncio.create_task(post(client, busy, **{"x-max-wait": "600"}))
    await busy.until(lambda: busy.service.admission.queued == 1)
    standin.hurry()
    assert (await waiting).status_code == 200


async def test_a_bound_that_is_not_a_number_is_refused_before_it_waits(
    busy: RunningGate, client: httpx.AsyncClient
) -> None:
    answer = await post(client, busy, **{"x-max-wait": "soon"})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "X-Max-Wait"
    assert busy.service.admission.queued == 0


async def test_a_request_in_a_models_line_is_held_to_its_own_lines_estimate(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(1), "beta": hosted(1)})
    gate = await gate_before(upstream)
    alpha = gate.service.models.find("alpha")
    assert alpha is not None
    kid = children(upstream)["alpha"]
    kid.token_delay_s = 0.5  # a hold of 1.5 s seen: alpha's estimate stays above 0.5 s
    assert (await client.post(gate.url + CHAT, json=chat(model="alpha"))).status_code == 200
    kid.tokens = 1000
    holder = asyncio.create_task(client.post(gate.url + CHAT, json=chat(model="alpha")))
    try:
        await gate.until(lambda: alpha.admission.active == 1)
        bound = {"x-max-wait": "0.2"}
        # alpha's line is busy: its estimate, not the idle main line's, refuses the request
        # at once, rather than after waiting out its bound.
        refused = await client.post(gate.url + CHAT, json=chat(model="alpha"), headers=bound)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert error["eta_s"] > 0.2
        assert error["message"].startswith("the expected wait for a slot")
        # beta's line is free: the same bound lets it straight in.
        served = await client.post(gate.url + CHAT, json=chat(model="beta"), headers=bound)
        assert served.status_code == 200
    finally:
        upstream.hurry()
        await cancel_all([holder])


async def test_a_request_for_an_unloaded_model_is_held_to_its_last_load_time(
    router: MakeRouter, gate_before: GatesFor, client: httpx.AsyncClient
) -> None:
    upstream = await router({"alpha": hosted(1, "unloaded")}, load_delay_s=0.5)
    gate = await gate_before(upstream)
    alpha = gate.service.models.find("alpha")
    assert alpha is not None
    # The first load's time is not known yet: a bound waits for it rather than guessing.
    first = await client.post(
        gate.url + CHAT, json=chat(model="alpha"), headers={"x-max-wait": "60"}
    )
    assert first.status_code == 200
    assert alpha.load_s is not None
    assert alpha.load_s >= 0.5
    assert upstream.hosted is not None
    upstream.hosted["alpha"].state = "unloaded"  # evicted, as a router full of models does
    await gate.until(lambda: not alpha.running)
    refused = await client.post(
        gate.url + CHAT, json=chat(model="alpha"), headers={"x-max-wait": "0.2"}
    )
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "deadline_unmet"
    assert error["eta_s"] >= 0.5
    assert alpha.admission.queued == 0
    # Refused at once: nothing waited, so nothing asked for a load.
    assert upstream.routing is not None
    assert upstream.routing.loads == 1


async def test_two_bounds_are_refused_not_one_picked(
    busy: RunningGate, client: httpx.AsyncClient
) -> None:
    answer = await client.post(
        busy.url + CHAT, json=chat(),
        headers=[("authorization", "Bearer sk-patient"), ("x-max-wait", "600"),
                 ("x-max-wait", "0")],
    )  # fmt: skip
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "X-Max-Wait"
    assert busy.service.admission.queued == 0
