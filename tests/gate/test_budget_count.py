"""The KV-cache budget at its edges: start-up, a llama-server that says odd things, and the exact
count when llama-server is slow or its answers are not what they should be."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from slotgate.asgi import Header
from slotgate.errors import AdmissionError
from slotgate.gate.admission import Admission
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.ticket import Ticket
from slotgate.intake.cost import local
from slotgate.intake.endpoints import ENDPOINTS
from slotgate.upstreams.client import Response
from slotgate.upstreams.props import Props
from slotgate.upstreams.server import Requester

from tests.conftest import CHAT, GateFactory, counting, words
from tests.support.harness import PassingClient
from tests.support.standin import StandIn


@pytest.fixture
def standin(standin: StandIn) -> StandIn:
    return counting(standin)


class Counts(PassingClient):
    """An upstream's client that passes everything on, noting each count asked and the size of
    each count answer read whole."""

    def __init__(self, client: Requester) -> None:
        super().__init__(client)
        self.asked: list[str] = []
        self.read: list[int] = []

    async def request(
        self, method: str, target: str, headers: Iterable[Header], body: bytes
    ) -> Response:
        response = await self.client.request(method, target, headers, body)
        if target in ("/apply-template", "/tokenize"):
            self.asked.append(target)
            return CountAnswer(response, self.read)
        return response


class CountAnswer:
    """A count's answer that notes the size of its body once it is read whole."""

    def __init__(self, response: Response, read: list[int]) -> None:
        self._response = response
        self._read = read
        self.status = response.status
        self.headers = response.headers
        self.content_type = response.content_type
        self.content_length = response.content_length

    def header(self, name: bytes) -> bytes | None:
        return self._response.header(name)

    async def readany(self) -> bytes:
        return await self._response.readany()

    async def read(self, limit_bytes: int | None = None) -> bytes:
        body = await self._response.read(limit_bytes)
        self._read.append(len(body))
        return body

    def when_done(self, callback: Callable[[], object]) -> None:
        self._response.when_done(callback)

    def release(self) -> None:
        self._response.release()

    def close(self) -> None:
        self._response.close()


# -- the admission core -----------------------------------------------------------------------


def budgeted(budget: int, **options: Any) -> Admission:
    """An admission core with a KV budget of `budget` tokens."""
    admission = Admission(QueuePolicy(), **options)
    admission.resize_budget(budget)
    return admission


@pytest.mark.parametrize("budget", [-5, 0])
async def test_a_budget_that_is_not_positive_does_not_bind_and_nothing_goes_negative(
    budget: int,
) -> None:
    admission = budgeted(budget, capacity=4)
    ticket = admission.enter(1, 50)
    assert ticket.admitted
    assert admission.budget_tokens is None
    assert admission.committed_tokens == 50
    ticket.release()
    assert admission.committed_tokens == 0


async def test_a_cost_taken_while_the_capacity_is_unknown_is_cut_to_the_budget() -> None:
    admission = budgeted(100, startup_wait_s=5)
    ticket = admission.enter(1, 5000)
    assert ticket.cost == 100
    admission.resize(2)
    await ticket.wait()
    assert admission.committed_tokens == 100
    ticket.release()
    assert admission.committed_tokens == 0


async def test_waiters_let_in_as_the_capacity_becomes_known_are_weighed_by_the_budget() -> None:
    admission = budgeted(100, startup_wait_s=5)
    tickets = [admission.enter(1, 60) for _ in range(3)]
    admission.resize(4)
    await asyncio.sleep(0)
    assert [t.granted for t in tickets] == [True, False, False]
    assert admission.committed_tokens == 60


# -- what llama-server says --------------------------------------------------------------------


@pytest.mark.parametrize("n_ctx", [-1024, 0])
def test_a_context_size_that_is_not_positive_is_taken_as_unknown(n_ctx: int) -> None:
    props = Props.parse({"total_slots": 4, "default_generation_settings": {"n_ctx": n_ctx}})
    assert props.n_ctx is None


# -- through the gate --------------------------------------------------------------------------


async def test_requests_that_arrive_while_llama_server_starts_are_admitted_by_the_budget(
    loading_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    gate = await loading_gate(kv_budget_tokens=1000, startup_wait_s=10)
    waiting = [
        asyncio.create_task(client.post(gate.url + CHAT, json=words(300, max_tokens=80)))
        for _ in range(4)
    ]
    await gate.until(lambda: gate.service.admission.queued == 4)
    standin.loading = False
    answers = await asyncio.gather(*waiting)
    assert [a.status_code for a in answers] == [200] * 4
    assert standin.max_running <= 2  # 380 tokens each at best: never four at once in 1000
    assert gate.service.admission.committed_tokens == 0


async def test_a_count_that_llama_server_is_too_slow_for_falls_back_to_the_local_bound(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.tokens = 200
    gate = await start_gate(kv_budget_tokens=1000)
    gate.service.upstream.count_timeout_s = 0.5
    # Each half of the count is within the bound, the two together are not.
    standin.count_delay_s = 0.3
    body = words(10, stream=True, max_tokens=50)
    bound = local(ENDPOINTS[CHAT], body, 1000).reserve
    assert bound > 60  # what the count would have said: 10 words, 50 to generate
    async with client.stream("POST", gate.url + CHAT, json=body):
        await gate.until(lambda: gate.service.admission.active == 1)
        assert gate.service.admission.committed_tokens == bound
    await gate.until(lambda: gate.service.admission.committed_tokens == 0)


async def test_a_count_answer_too_long_for_its_prompt_is_not_read_and_falls_back(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.count_answer = b'{"prompt": "' + b"x" * (4 * 1024 * 1024) + b'"}'
    gate = await start_gate(kv_budget_tokens=1000)
    upstream = gate.service.upstream
    counts = Counts(upstream._client)
    upstream._client = counts
    answer = await client.post(gate.url + CHAT, json=words(10, max_tokens=50))
    assert answer.status_code == 200
    assert counts.asked == ["/apply-template"]
    assert counts.read == []  # the oversized answer raised before it was handed over
    assert gate.service.admission.committed_tokens == 0


async def test_a_client_that_leaves_while_its_prompt_is_counted_takes_no_tokens_and_no_upstream(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    gate = await start_gate(kv_budget_tokens=1000)
    # A count that takes 1.5 s: the client leaves well within it, however loaded the machine.
    standin.count_delay_s = 1.5
    leaving = asyncio.create_task(client.post(gate.url + CHAT, json=words(10, max_tokens=50)))
    await gate.until(lambda: gate.service.admission.committed_tokens > 0)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await gate.until(lambda: gate.service.admission.committed_tokens == 0)
    assert gate.service.admission.active == 0
    await asyncio.sleep(1.6)  # past the count's delay: a request that went on would be running
    assert standin.started == 0


async def test_waiters_in_line_when_a_budget_is_learned_are_not_let_in_together() -> None:
    admission = Admission(QueuePolicy(), capacity=2)
    running = [admission.enter(1), admission.enter(1)]
    waiting = [admission.enter(1), admission.enter(1)]
    # llama-server ran out of its shared cache: the budget is learned while two wait, priced
    # at nothing since no budget bound when they came.
    admission.resize_budget(100)
    for ticket in running:
        ticket.release()
    await asyncio.sleep(0)
    assert [t.granted for t in waiting] == [True, False]  # what they take is unknown: all
    assert admission.committed_tokens == 100
    waiting[0].release()
    await asyncio.sleep(0)
    assert waiting[1].granted
    waiting[1].release()
    assert admission.committed_tokens == 0
    assert not list(admission._line.tickets())


_COSTS = st.sampled_from([0, 10, 40, 60, 90, 150])  # around a budget of 100
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enter"), st.integers(1, 2), _COSTS),
        st.tuples(st.just("release"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("recost"), st.integers(0, 30), _COSTS),
        st.tuples(st.just("capacity"), st.integers(1, 4), st.just(0)),
        st.tuples(st.just("budget"), st.sampled_from([None, 0, 60, 100, 200]), st.just(0)),
    ),
    max_size=40,
)


@given(ops=_OPS)
def test_tokens_and_slots_add_up_and_nobody_overtakes_under_any_sequence(
    ops: list[tuple[str, Any, int]],
) -> None:
    asyncio.run(_replay(ops))


async def _replay(ops: list[tuple[str, Any, int]]) -> None:
    admission = Admission(QueuePolicy(max_queue=0), capacity=2)
    admission.resize_budget(100)
    tickets: list[Ticket] = []
    for op, a, b in ops:
        before = {id(t) for t in tickets if t.granted}
        if op == "enter":
            with contextlib.suppress(AdmissionError):
                tickets.append(admission.enter(a, b))
        elif op == "release" and tickets:
            tickets[a % len(tickets)].release()
        elif op == "recost" and tickets:
            tickets[a % len(tickets)].recost(b)
        elif op == "capacity":
            admission.resize(a)
        elif op == "budget":
            admission.resize_budget(a)
        for _ in range(3):
            await asyncio.sleep(0)
        held = [t for t in tickets if t.granted and not t._released]
        # What each holds: its cost cut to the budget, or the whole budget had it come before
        # the budget bound (what it takes was unknown then).
        assert admission.committed_tokens == sum(t.charged for t in held)
        assert admission.active == sum(t.weight for t in held)
        assert admission.committed_tokens >= 0
        waiting = [
            t for t in tickets if t._future is not None and not t._future.done() and not t._released
        ]
        new = [t for t in held if id(t) not in before]
        for t in new:
            assert all(w.seq > t.seq for w in waiting), "a later request overtook the line"
        budget = admission.budget_tokens
        if new and budget is not None:
            holding = sum(t.charged for t in held if id(t) in before)
            if holding + sum(t.charged for t in new) > budget:  # only as one that runs alone
                assert holding == 0
                assert len([t for t in new if t.charged]) == 1
    for ticket in tickets:
        ticket.release()
    assert admission.committed_tokens == 0
    assert admission.active == 0
    assert not list(admission._line.tickets())


async def test_a_client_that_leaves_while_waiting_for_tokens_leaves_nothing_held(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.tokens = 500
    gate = await start_gate(kv_budget_tokens=1000)
    admission = gate.service.admission
    async with client.stream("POST", gate.url + CHAT, json=words(10, stream=True, max_tokens=900)):
        await gate.until(lambda: admission.active == 1)
        held = admission.committed_tokens
        leaving = asyncio.create_task(client.post(gate.url + CHAT, json=words(10, max_tokens=500)))
        await gate.until(lambda: admission.queued == 1)
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await gate.until(lambda: admission.queued == 0)
        assert admission.committed_tokens == held
        assert not list(admission._line.tickets())
        assert gate.service.proxy.body_bytes.held == 0
    await gate.until(lambda: admission.committed_tokens == 0)
    assert admission.active == 0


async def test_a_waiting_request_refused_as_too_long_gives_back_its_body_bytes(
    start_gate: GateFactory, client: httpx.AsyncClient, standin: StandIn
) -> None:
    standin.tokens = 500
    gate = await start_gate(kv_budget_tokens=1000, queue_body_bytes=100_000)
    async with client.stream("POST", gate.url + CHAT, json=words(300, stream=True, max_tokens=600)):
        await gate.until(lambda: gate.service.admission.active == 1)
        refused = await client.post(gate.url + CHAT, json=words(1200))
        assert refused.status_code == 400
        assert refused.json()["error"]["type"] == "exceed_context_size_error"
        assert gate.service.proxy.body_bytes.held == 0
