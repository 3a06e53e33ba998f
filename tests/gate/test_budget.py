"""The KV-cache budget: the admission core's token accounting, the cost of a request, and the
gate in front of a stand-in whose slots share one cache."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from slotgate.engine.engines import Engines
from slotgate.engine.process import LocalEngine
from slotgate.errors import ContextExceeded
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.ticket import Ticket
from slotgate.intake.cost import counted, estimate, local
from slotgate.intake.endpoints import ENDPOINTS
from slotgate.settings import Settings

from tests.conftest import GateFactory, counting, words
from tests.support.limits import OUTPUT_LIMITS
from tests.support.standin import StandIn

CHAT = ENDPOINTS["/v1/chat/completions"]


def pool(capacity: int = 4, budget: int | None = 100) -> Admission:
    admission = Admission(QueuePolicy(), capacity=capacity)
    admission.resize_budget(budget)
    return admission


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def waiting(ticket: Ticket) -> asyncio.Task[None]:
    """The ticket's request, waiting for its turn."""
    task = asyncio.create_task(ticket.wait())
    await settle()
    return task


async def give_up(task: asyncio.Task[None]) -> None:
    """The waiting request leaves (its client went away)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# -- the admission core -----------------------------------------------------------------------


async def test_a_request_whose_tokens_do_not_fit_waits_with_slots_free() -> None:
    admission = pool()
    first = admission.enter(1, 60)
    second = admission.enter(1, 60)
    assert first.admitted
    assert not second.admitted
    assert admission.snapshot().free_tokens == 40
    first.release()
    await second.wait()
    assert admission.committed_tokens == 60


async def test_nobody_overtakes_a_head_that_does_not_fit() -> None:
    admission = pool()
    admission.enter(1, 60)
    big = admission.enter(1, 60)
    small = admission.enter(1, 10)  # would fit the 40 left, but the head waits first
    await settle()
    assert not big.granted
    assert not small.granted
    big.release()  # the head gives up: the one behind it fits now
    await settle()
    assert small.granted


async def test_a_request_above_the_whole_budget_runs_alone_once_nothing_holds_tokens() -> None:
    admission = pool()
    running = admission.enter(1, 10)
    huge = admission.enter(1, 5000)
    assert huge.cost == 100  # cut to the budget: it can never need more than all of it
    await settle()
    assert not huge.granted
    running.release()
    await huge.wait()
    assert admission.committed_tokens == 100
    assert admission.snapshot().free_tokens == 0


async def test_tokens_come_back_once_and_never_go_negative() -> None:
    admission = pool()
    ticket = admission.enter(1, 30)
    ticket.release()
    ticket.release()
    assert admission.committed_tokens == 0
    assert admission.active == 0


async def test_a_waiter_that_leaves_takes_no_tokens_with_it() -> None:
    admission = pool()
    holder = admission.enter(1, 90)
    waiter = admission.enter(1, 50)
    await give_up(await waiting(waiter))
    holder.release()
    assert (admission.committed_tokens, admission.queued) == (0, 0)


async def test_a_waiter_handed_tokens_as_it_gives_up_passes_them_on() -> None:
    admission = pool()
    holder = admission.enter(1, 90)
    leaving = admission.enter(1, 50)
    behind = admission.enter(1, 50)
    task = await waiting(leaving)
    holder.release()  # hands 50 to `leaving`, whose waiter has not resumed yet
    await give_up(task)
    await settle()
    assert behind.granted
    assert admission.committed_tokens == 50


async def test_a_larger_budget_admits_waiters_and_a_smaller_one_holds_new_ones() -> None:
    admission = pool()
    admission.enter(1, 80)
    waiter = admission.enter(1, 80)
    admission.resize_budget(200)
    await settle()
    assert waiter.granted
    admission.resize_budget(100)  # 160 held: nothing more until they come back under 100
    later = admission.enter(1, 10)
    assert not later.admitted
    assert admission.snapshot().free_tokens == 0


async def test_without_a_budget_tokens_never_hold_anyone_back() -> None:
    admission = pool(budget=None)
    tickets = [admission.enter(1, 10_000) for _ in range(4)]
    assert all(ticket.admitted for ticket in tickets)
    assert admission.snapshot().free_tokens is None
    for ticket in tickets:
        ticket.release()
    assert admission.committed_tokens == 0


# -- the cost of a request --------------------------------------------------------------------


def test_the_local_estimate_counts_every_prompt_byte_and_the_output_times_the_choices() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 80, "n": 2}
    cost = estimate(CHAT, body)
    assert cost.prompt >= 2 * 300
    assert cost.output == 160
    assert estimate(CHAT, {"messages": []}).output is None


def test_a_request_is_charged_the_output_llama_server_will_let_it_generate() -> None:
    budget = 100_000
    wrong = []
    for path, body, default, tokens in OUTPUT_LIMITS:
        endpoint = ENDPOINTS[path]
        # No limit: it may run to the end of its slot's context, so it is charged the budget.
        expected = budget if tokens is None else estimate(endpoint, body).prompt + tokens
        reserve = local(endpoint, body, budget, default).reserve
        if reserve != expected:
            wrong.append((path, body, default, reserve, expected))
    assert wrong == []


async def test_a_counted_prompt_that_fills_the_context_is_refused_in_llama_servers_words() -> None:
    async def count(chat: bool, payload: dict[str, Any]) -> int:
        return 1024

    with pytest.raises(ContextExceeded) as caught:
        await counted(local(CHAT, {"messages": [], "max_tokens": 1}, 1024), count)
    assert caught.value.extra == {"n_prompt_tokens": 1024, "n_ctx": 1024}


async def test_a_count_replaces_the_bound_and_no_output_limit_reserves_the_rest() -> None:
    async def count(chat: bool, payload: dict[str, Any]) -> int:
        return 300

    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x" * 2000}]}
    bounded = local(CHAT, {**body, "max_tokens": 80}, 1024)
    assert bounded.reserve == 1024  # 2000 bytes: the bound alone is over the budget
    assert await counted(bounded, count) == 380
    assert await counted(local(CHAT, body, 1024), count) == 1024
    assert await counted(local(CHAT, body, 1024, default_output=100), count) == 400


async def test_a_lower_cost_in_line_or_admitted_lets_the_line_move() -> None:
    admission = pool()
    first = admission.enter(1, 100)
    second = admission.enter(1, 100)
    third = admission.enter(1, 30)
    second.recost(40)  # counted while waiting: still behind 100
    await settle()
    assert not second.granted
    first.recost(50)  # counted once admitted: 50 + 40 fit, 50 + 40 + 30 do not
    await settle()
    assert second.granted
    assert not third.granted
    assert admission.committed_tokens == 90
    first.release()
    second.release()
    await settle()
    assert third.granted
    assert admission.committed_tokens == 30


# -- through the gate -------------------------------------------------------------------------


@pytest.fixture
def standin(standin: StandIn) -> StandIn:
    return counting(standin)


async def test_the_budget_set_shows_in_the_snapshot_and_the_metrics(
    start_gate: GateFactory, client: httpx.AsyncClient
) -> None:
    gate = await start_gate(kv_budget_tokens=1000)
    snapshot = (await client.get(gate.url + "/admission")).json()
    assert snapshot["budget_tokens"] == 1000
    assert snapshot["free_tokens"] == 1000
    metrics = (await client.get(gate.url + "/metrics")).text
    assert "slotgate_kv_budget_tokens 1000.0" in metrics


@pytest.mark.parametrize("setting", [None, 0])
async def test_unset_or_zero_the_budget_does_not_bind(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn, setting: int | None
) -> None:
    gate = await start_gate(kv_budget_tokens=setting)
    answers = await asyncio.gather(
        *(client.post(gate.url + "/v1/chat/completions", json=words(900)) for _ in range(4))
    )
    assert [a.status_code for a in answers] == [200] * 4
    assert standin.max_running == 4
    assert gate.service.admission.budget_tokens is None


async def test_requests_that_together_exceed_the_budget_take_turns(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    gate = await start_gate(kv_budget_tokens=1000)
    answers = await asyncio.gather(
        *(
            client.post(gate.url + "/v1/chat/completions", json=words(300, max_tokens=80))
            for _ in range(4)
        )
    )
    assert [a.status_code for a in answers] == [200] * 4
    assert standin.max_running == 2  # 380 each: two fit in 1000, three do not
    assert gate.service.admission.committed_tokens == 0


async def test_a_prompt_longer_than_the_cache_is_refused_before_it_waits(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    gate = await start_gate(kv_budget_tokens=1000)
    answer = await client.post(gate.url + "/v1/chat/completions", json=words(1200))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_prompt_tokens"] == 1200
    assert error["n_ctx"] == 1000
    assert "exceeds the available context size (1000 tokens)" in error["message"]
    assert standin.started == 0
    assert gate.service.admission.committed_tokens == 0  # it held a place while counted
    assert gate.service.admission.active == 0


async def test_tokens_come_back_when_the_client_leaves(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.tokens = 1000
    gate = await start_gate(kv_budget_tokens=1000)
    async with client.stream(
        "POST", gate.url + "/v1/chat/completions", json=words(10, stream=True, max_tokens=50)
    ) as response:
        await response.aiter_bytes().__anext__()
        assert gate.service.admission.committed_tokens == 60
    await gate.until(lambda: gate.service.admission.committed_tokens == 0)


@pytest.mark.parametrize("fault", ["die_midstream", "garbage", "error_400"])
async def test_tokens_come_back_when_llama_server_fails(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn, fault: str
) -> None:
    standin.fault = fault
    gate = await start_gate(kv_budget_tokens=1000, stream_upstream=False)
    await client.post(gate.url + "/v1/chat/completions", json=words(10, max_tokens=50))
    await gate.until(lambda: gate.service.admission.committed_tokens == 0)
    assert gate.service.admission.active == 0


async def test_a_full_line_says_how_much_of_the_budget_is_held(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.tokens = 200
    gate = await start_gate(kv_budget_tokens=1000, max_queue=1)
    body = words(300, max_tokens=500, stream=True)
    async with client.stream("POST", gate.url + "/v1/chat/completions", json=body):
        waiting = asyncio.create_task(client.post(gate.url + "/v1/chat/completions", json=body))
        await gate.until(lambda: gate.service.admission.queued == 1)
        refused = await client.post(gate.url + "/v1/chat/completions", json=body)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    assert refused.status_code == 429
    assert standin.counted == 2  # the refused request cost llama-server nothing
    snapshot = refused.json()["error"]["admission"]
    assert snapshot["budget_tokens"] == 1000
    assert snapshot["committed_tokens"] == 800
    assert snapshot["free_tokens"] == 200
    assert json.dumps(snapshot)


def test_an_engine_slotgate_starts_knows_its_budget() -> None:
    unified = LocalEngine(Path("m.gguf"), parallel=4, ctx_size=1024, threads=1, kv_unified=True)
    assert unified.kv_budget_tokens == 1024
    assert "--kv-unified" in unified.command(1234)
    split = LocalEngine(Path("m.gguf"), parallel=4, ctx_size=1024, threads=1)
    assert split.kv_budget_tokens == 0  # each slot has a context of its own
    assert "--kv-unified" not in split.command(1234)


async def test_a_single_slot_needs_no_budget(start_gate: GateFactory, standin: StandIn) -> None:
    standin.total_slots = 1
    gate = await start_gate(kv_budget_tokens=1000)
    assert gate.service.admission.budget_tokens is None


@pytest.mark.parametrize(("setting", "learned"), [(None, 1024), (0, None), (500, 500)])
async def test_running_out_of_a_shared_cache_teaches_the_budget_unless_it_was_set(
    start_gate: GateFactory,
    client: httpx.AsyncClient,
    standin: StandIn,
    setting: int | None,
    learned: int | None,
) -> None:
    gate = await start_gate(kv_budget_tokens=setting)
    standin.fault = "out_of_cache"
    answer = await client.post(gate.url + "/v1/chat/completions", json=words(10))
    assert answer.status_code == 500
    assert gate.service.admission.budget_tokens == learned
    await asyncio.sleep(0.3)  # a /props refresh keeps what was learned
    assert gate.service.admission.budget_tokens == learned
    snapshot = (await client.get(gate.url + "/admission")).json()
    assert snapshot["budget_tokens"] == learned


@pytest.mark.parametrize(("env", "expected"), [(None, 1024), ("0", 0), ("700", 700)])
def test_slotgate_tells_the_gate_what_its_own_engine_shares_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: str | None, expected: int
) -> None:
    from slotgate import cli

    engine = LocalEngine(Path("m.gguf"), parallel=4, ctx_size=1024, threads=1, kv_unified=True)
    monkeypatch.setattr(LocalEngine, "from_args", classmethod(lambda cls, **_: engine))
    monkeypatch.setattr(Engines, "start", lambda self: None)
    monkeypatch.setattr(Engines, "stop", lambda self: None)
    engine.url = "http://127.0.0.1:9"
    seen: list[Settings] = []

    def serve(settings: Settings, engine_exit: object, sockets: object) -> int:
        seen.append(settings)
        return 0

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli, "_print_usage", lambda settings, port: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PORT", "0")  # slotgate listens before it starts its engine
    if env is None:
        monkeypatch.delenv("KV_BUDGET_TOKENS", raising=False)
    else:
        monkeypatch.setenv("KV_BUDGET_TOKENS", env)
    assert cli.main(["--demo"]) == 0
    assert seen[0].kv_budget_tokens == expected


async def test_a_waiter_counted_at_no_cost_leaves_nothing_behind() -> None:
    admission = pool(capacity=1)
    holder = admission.enter(1, 10)
    waiter = admission.enter(1, 50)
    waiter.recost(0)
    holder.release()
    await waiter.wait()
    waiter.release()
    assert not list(admission._line.tickets())
    assert admission.committed_tokens == 0
