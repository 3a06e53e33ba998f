"""Agent sessions through the whole gate, in front of stand-ins: a session's turns stay on the
upstream that has its cache, and with SESSION_FLOWS one session's flood does not hold back
another's next request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from slotgate.settings import Settings

from tests.conftest import (
    CHAT,
    GateFactory,
    GatesFor,
    MakeRouter,
    RunningGate,
    StartUpstreams,
    cancel_all,
    serve,
)
from tests.support.router import children, hosted
from tests.support.standin import StandIn


def turn(n: int) -> dict[str, Any]:
    """A chat whose prompt's start (so its affinity key) is its own."""
    return {"messages": [{"role": "user", "content": f"turn {n} " * 80}], "stream": False}


async def spread(
    send: Callable[[int], Awaitable[httpx.Response]], upstreams: Sequence[StandIn]
) -> None:
    """Turns of prompts of their own sent one by one until every upstream has seen one. Which
    upstream a key picks hangs on the upstreams' addresses (their ports, drawn at random), so
    ten keys all land on one of two upstreams once in 512 runs: they are sent until both have
    one, forty at most (all on one: once in 2^39)."""
    for n in range(40):
        answer = await send(n)
        assert answer.status_code == 200
        if all(upstream.seen for upstream in upstreams):
            return
    raise AssertionError("forty prompts of their own, all on one upstream")


async def test_a_sessions_turns_stay_on_one_upstream_whatever_their_prompts(
    start_upstreams: StartUpstreams, client: httpx.AsyncClient
) -> None:
    upstreams = [StandIn(total_slots=2, tokens=2), StandIn(total_slots=2, tokens=2)]
    await start_upstreams(*upstreams)
    gate = await serve_fleet(upstreams)
    try:
        # Prompts of their own spread over both by their keys.
        await spread(lambda n: client.post(gate.url + CHAT, json=turn(n)), upstreams)
        before = [len(u.seen) for u in upstreams]
        for n in range(10):
            answer = await client.post(
                gate.url + CHAT, json=turn(n), headers={"x-claude-code-session-id": "sess-1"}
            )
            assert answer.status_code == 200
        after = [len(u.seen) - b for u, b in zip(upstreams, before, strict=True)]
        assert sorted(after) == [0, 10]  # one session, one upstream
    finally:
        await gate.stop()


async def serve_fleet(upstreams: list[StandIn], **overrides: Any) -> RunningGate:
    gate = await serve(
        Settings(
            _env_file=None, llama_server_url=",".join(u.url for u in upstreams),
            props_refresh_interval_s=0.2, keepalive_interval_s=0, log_level="warning",
            **overrides,
        )
    )  # fmt: skip
    await gate.until(lambda: all(p.capacity for p in gate.service.admission.pools))
    return gate


def said(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "stream": False}


def in_session(text: str, session: str, by: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A request of `session`, named `by` a header, or by its body's prompt_cache_key."""
    if by == "prompt_cache_key":
        return {**said(text), "prompt_cache_key": session}, {}
    return said(text), {by: session}


async def chat_after_a_flood(
    gate: RunningGate, client: httpx.AsyncClient, standin: StandIn, flood: int,
    by: tuple[str, str] = ("session-id", "x-session-affinity"),
) -> list[str]:  # fmt: skip
    """Session `a` sends `flood` requests at once, session `b` one once the rest of them
    wait (each naming its session `by` a header or the body): the prompts in the order the
    stand-in ran them from then on."""
    sent = [in_session(f"flood {n}", "a", by[0]) for n in range(flood)]
    tasks = [
        asyncio.create_task(client.post(gate.url + CHAT, json=body, headers=headers))
        for body, headers in sent
    ]
    try:
        await gate.until(lambda: gate.service.admission.queued >= flood - 2)
        before = len(standin.seen)
        body, headers = in_session("chat", "b", by[1])
        answer = await client.post(gate.url + CHAT, json=body, headers=headers)
        assert answer.status_code == 200
        return [json.loads(s.body)["messages"][0]["content"] for s in standin.seen[before:]]
    finally:
        await cancel_all(tasks)


async def test_one_sessions_flood_does_not_hold_back_another_sessions_request(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 10, 0.02
    gate = await start_gate(session_flows=16, max_queue=0)
    seen = await chat_after_a_flood(gate, client, standin, 30)
    # Behind about 28 of the flood in one line, yet among the next two to run.
    assert seen.index("chat") <= 2, seen


async def test_a_bodys_prompt_cache_key_names_a_session_for_its_own_flow(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    # Each of the flood's answers holds the slot a second: a loaded machine that is slow to
    # put the chat in line lets no more of them run before it.
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 50, 0.02
    gate = await start_gate(session_flows=16, max_queue=0)
    by = ("prompt_cache_key", "prompt_cache_key")
    seen = await chat_after_a_flood(gate, client, standin, 30, by)
    assert seen.index("chat") <= 2, seen


async def test_without_session_flows_a_session_waits_its_turn_in_one_line(
    start_gate: GateFactory, standin: StandIn, client: httpx.AsyncClient
) -> None:
    standin.total_slots, standin.tokens, standin.token_delay_s = 1, 2, 0.01
    gate = await start_gate(max_queue=0)
    seen = await chat_after_a_flood(gate, client, standin, 8)
    assert seen.index("chat") >= 6, seen


async def test_a_sessions_turns_stay_on_one_router_among_those_serving_its_model(
    router: MakeRouter, gates_for: GatesFor, client: httpx.AsyncClient
) -> None:
    routers = [await router({"alpha": hosted(2)}), await router({"alpha": hosted(2)})]
    gate = await gates_for(routers)
    await gate.until(
        lambda: (
            (lane := gate.service.models.find("alpha")) is not None and lane.admission.capacity == 4
        )
    )
    kids = [children(r)["alpha"] for r in routers]
    # Prompts of their own spread over both routers by their keys.
    await spread(lambda n: client.post(gate.url + CHAT, json={**turn(n), "model": "alpha"}), kids)
    before = [len(kid.seen) for kid in kids]
    for n in range(10, 20):
        answer = await client.post(
            gate.url + CHAT, json={**turn(n), "model": "alpha"},
            headers={"x-claude-code-session-id": "sess-1"},
        )  # fmt: skip
        assert answer.status_code == 200
    after = [len(kid.seen) - b for kid, b in zip(kids, before, strict=True)]
    assert sorted(after) == [0, 10]  # one session, one router
