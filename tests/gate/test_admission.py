"""The admission core on its own: order, limits, timeouts, cancellation races, resizing."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
from slotgate.errors import NotReady, QueueFull, QueueTimeout, ShuttingDown, TooLarge
from slotgate.gate import admission as admission_module
from slotgate.gate import clock as clock_module
from slotgate.gate import ticket as ticket_module
from slotgate.gate.admission import Admission
from slotgate.gate.clock import RETRY_AFTER_CAP_S
from slotgate.gate.entry import Entry, Local
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.ticket import Ticket


def pool(capacity: int | None = 2, **policy: int | None) -> Admission:
    return Admission(QueuePolicy(**policy), capacity=capacity)


async def settle() -> None:
    """Let every ready callback and task run."""
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("policy", "capacity", "limit"),
    [
        ({}, 2, 64),  # default 16 per slot, floored at the default 64
        ({}, 8, 128),  # 16 x 8 is above the floor
        ({"min_queue": 10}, 2, 32),  # an explicit floor replaces the default one
        ({"min_queue": 100}, 2, 100),
        ({"queue_per_slot": 3}, 2, 6),  # an explicit multiplier gets no default floor
        ({"queue_per_slot": 3, "min_queue": 10}, 2, 10),  # ... unless a floor is set too
        ({"queue_per_slot": 0}, 2, None),  # 0 per slot: unbounded
        ({"max_queue": 5}, 2, 5),  # a fixed limit wins over everything
        ({"max_queue": 5, "queue_per_slot": 100, "min_queue": 100}, 2, 5),
        ({"max_queue": 0}, 2, None),  # MAX_QUEUE=0: unbounded
    ],
)
def test_queue_limit_follows_every_rule(
    policy: dict[str, int], capacity: int, limit: int | None
) -> None:
    assert QueuePolicy(**policy).limit(capacity) == limit


async def test_free_slots_are_taken_at_once_and_in_order() -> None:
    admission = pool(2)
    a, b = admission.enter(), admission.enter()
    assert a.admitted
    assert b.admitted
    c = admission.enter()
    assert not c.admitted
    assert (admission.active, admission.queued) == (2, 1)


async def test_the_local_gate_decides_with_a_plain_call_granted_or_in_line() -> None:
    admission = pool(1)
    gate = Local(admission)
    first = gate.enter_now(Entry(1))
    assert isinstance(first, Ticket)  # a claim, not a coroutine to await
    assert first.admitted
    # Granted as it entered: the moment it holds from is the moment it entered.
    assert admission._holders[first][0] == first.entered_at == first.admitted_at
    second = gate.enter_now(Entry(1))
    assert isinstance(second, Ticket)
    assert not second.admitted
    assert (admission.active, admission.queued) == (1, 1)
    assert first.release()  # handed on to the one waiting
    await second.wait()
    assert second.admitted
    assert not second.release()  # nobody waits: nothing handed on
    assert (admission.active, admission.queued) == (0, 0)
    third = await gate.enter(Entry(1))  # the awaited way in decides the same
    assert third.admitted
    third.release()


async def test_waiters_are_admitted_in_arrival_order() -> None:
    admission = pool(1)
    holder = admission.enter()
    waiters = [admission.enter() for _ in range(5)]
    order: list[int] = []

    async def wait(i: int, ticket: Ticket) -> None:
        await ticket.wait()
        order.append(i)
        await asyncio.sleep(0)
        ticket.release()

    tasks = [asyncio.create_task(wait(i, t)) for i, t in enumerate(waiters)]
    await settle()
    holder.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]
    assert (admission.active, admission.queued) == (0, 0)


async def test_slots_handed_off_to_a_waiter_are_not_taken_by_a_newcomer() -> None:
    admission = pool(2)
    heavy_holder = admission.enter(2)
    heavy = admission.enter(2)  # waits for both slots
    heavy_holder.release()
    await settle()
    assert heavy.granted
    # heavy got both slots by hand-off; a light newcomer must now queue behind nobody...
    await heavy.wait()
    light = admission.enter(1)
    assert not light.admitted
    heavy.release()
    await light.wait()
    assert light.admitted


async def test_a_light_waiter_does_not_jump_a_heavy_head_of_line() -> None:
    admission = pool(2)
    holder = admission.enter(1)
    heavy = admission.enter(2)
    light = admission.enter(1)
    await settle()
    # One slot is free, but the head needs two: strict FIFO keeps the light one waiting.
    assert not heavy.granted
    assert not light.granted
    holder.release()
    await heavy.wait()
    assert heavy.admitted
    assert admission.active == 2


async def test_full_line_is_refused_with_a_snapshot() -> None:
    admission = pool(1, max_queue=2)
    admission.enter()
    admission.enter()
    admission.enter()
    with pytest.raises(QueueFull) as caught:
        admission.enter()
    snap = caught.value.snapshot
    assert (snap.capacity, snap.active, snap.queued, snap.queue_limit, snap.free) == (1, 1, 2, 2, 0)
    assert 1 <= caught.value.retry_after_s <= RETRY_AFTER_CAP_S


async def test_unbounded_line_takes_everyone() -> None:
    admission = pool(1, max_queue=0)
    admission.enter()
    for _ in range(5000):
        admission.enter()
    assert admission.queued == 5000
    assert admission.queue_limit is None


async def test_retry_after_grows_with_the_observed_hold_time_and_is_capped() -> None:
    admission = pool(1, max_queue=1)
    short = admission.retry_after_s(1)
    for _ in range(50):
        admission._clock.observe(30.0)  # long holds
    long = admission.retry_after_s(3)  # two holds from now: the free slot's, then one more
    assert short == 1.0
    assert 50 < long <= RETRY_AFTER_CAP_S
    assert admission.retry_after_s(1000) == RETRY_AFTER_CAP_S


async def test_before_any_hold_is_seen_retry_after_rests_on_the_holds_expected() -> None:
    admission = pool(2, max_queue=1)
    assert admission.retry_after_s(1) == 1.0
    admission.expect(6.0)
    admission.expect(10.0)
    assert admission.cold
    assert admission.hold_estimate_s == pytest.approx(8.0)
    # Two free slots take the first two; the third waits one expected hold.
    assert admission.retry_after_s(3) == pytest.approx(8.0)
    admission._clock.observe(3.0)  # the first hold seen replaces what was expected
    assert not admission.cold
    assert admission.hold_estimate_s == pytest.approx(3.0)
    admission.expect(30.0)  # and expectations no longer count
    assert admission.hold_estimate_s == pytest.approx(3.0)


async def test_unknown_capacity_refuses_as_not_ready() -> None:
    admission = pool(None)
    with pytest.raises(NotReady):
        admission.enter()


async def test_request_for_more_slots_than_exist_is_too_large() -> None:
    with pytest.raises(TooLarge):
        pool(2).enter(3)


async def test_waiting_longer_than_the_timeout_raises_and_leaves_the_line() -> None:
    admission = Admission(QueuePolicy(), capacity=1, queue_timeout_s=0.05)
    admission.enter()
    waiter = admission.enter()
    with pytest.raises(QueueTimeout) as caught:
        await waiter.wait()
    assert caught.value.snapshot.capacity == 1
    assert admission.queued == 0


async def test_cancelled_waiter_leaves_the_line_at_once() -> None:
    admission = pool(1, max_queue=1)
    holder = admission.enter()
    waiter = admission.enter()
    task = asyncio.create_task(waiter.wait())
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert admission.queued == 0
    admission.enter()  # its place is free for someone else
    holder.release()


async def test_waiter_cancelled_at_the_moment_of_handoff_passes_the_slot_on() -> None:
    admission = pool(1)
    holder = admission.enter()
    doomed = admission.enter()
    next_in_line = admission.enter()
    doomed_task = asyncio.create_task(doomed.wait())
    next_task = asyncio.create_task(next_in_line.wait())
    await settle()
    # Hand the slot to `doomed` and cancel it before its task can resume: the race.
    holder.release()
    doomed_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed_task
    await asyncio.wait_for(next_task, 10)
    assert next_in_line.admitted
    assert admission.active == 1
    next_in_line.release()
    assert (admission.active, admission.queued) == (0, 0)


async def test_release_of_a_granted_ticket_whose_waiter_never_resumed_passes_the_slot_on() -> None:
    admission = pool(1)
    holder = admission.enter()
    granted = admission.enter()
    after = admission.enter()
    holder.release()  # `granted` is handed the slot, but nobody awaits it
    granted.release()
    assert after.granted
    await after.wait()
    after.release()
    assert (admission.active, admission.queued) == (0, 0)


async def test_release_twice_is_harmless() -> None:
    admission = pool(1)
    ticket = admission.enter()
    ticket.release()
    ticket.release()
    assert admission.active == 0


async def test_growth_admits_waiters_at_once_in_order() -> None:
    admission = pool(1)
    admission.enter()
    waiters = [admission.enter() for _ in range(3)]
    admission.resize(3)
    assert admission.active == 3
    assert [w.granted for w in waiters] == [True, True, False]


async def test_shrink_retires_slots_as_holders_finish() -> None:
    admission = pool(3)
    holders = [admission.enter() for _ in range(3)]
    waiter = admission.enter()
    admission.resize(1)
    holders[0].release()
    holders[1].release()
    await settle()
    assert admission.active == 1  # nothing admitted past the new ceiling
    assert not waiter.granted
    holders[2].release()
    await waiter.wait()
    assert admission.active == 1


async def test_shrink_below_a_waiters_weight_turns_it_away() -> None:
    admission = pool(2)
    holder = admission.enter(2)
    heavy = admission.enter(2)
    admission.resize(1)
    with pytest.raises(TooLarge):
        await heavy.wait()
    holder.release()
    assert (admission.active, admission.queued) == (0, 0)


async def test_losing_capacity_keeps_the_line_and_refuses_newcomers() -> None:
    admission = pool(1)
    holder = admission.enter()
    waiter = admission.enter()
    admission.resize(None)
    with pytest.raises(NotReady):
        admission.enter()
    holder.release()
    await settle()
    assert not waiter.granted
    admission.resize(2)
    await waiter.wait()
    assert waiter.admitted


async def test_close_turns_the_line_away_and_refuses_newcomers() -> None:
    admission = pool(1)
    admission.enter()
    waiter = admission.enter()
    admission.close()
    with pytest.raises(ShuttingDown):
        await waiter.wait()
    with pytest.raises(ShuttingDown):
        admission.enter()


async def test_position_counts_from_the_head_of_the_line() -> None:
    admission = pool(1)
    admission.enter()
    waiters = [admission.enter() for _ in range(4)]
    assert [w.position for w in waiters] == [1, 2, 3, 4]
    waiters[0].release()
    assert waiters[1].position == 1


async def test_thousands_of_random_steps_leak_nothing() -> None:
    rng = random.Random(7)
    admission = Admission(QueuePolicy(max_queue=20), capacity=3)
    holders: list[Ticket] = []
    tasks: list[tuple[Ticket, asyncio.Task[None]]] = []
    refused = 0
    for _ in range(4000):
        step = rng.random()
        if step < 0.4:
            try:
                ticket = admission.enter(rng.choice((1, 1, 1, 2)))
            except QueueFull:
                refused += 1
                continue
            if ticket.admitted:
                holders.append(ticket)
            else:
                tasks.append((ticket, asyncio.create_task(ticket.wait())))
        elif step < 0.7 and holders:
            holders.pop(rng.randrange(len(holders))).release()
        elif tasks:
            ticket, task = tasks.pop(rng.randrange(len(tasks)))
            if rng.random() < 0.5:
                task.cancel()  # a client that gives up, possibly just as it is handed a slot
                await asyncio.sleep(0)
                ticket.release()
            else:
                tasks.append((ticket, task))
        await asyncio.sleep(0)
        # Move the ones whose wait finished over to the holders.
        for ticket, task in list(tasks):
            if task.done():
                tasks.remove((ticket, task))
                if not task.cancelled():
                    holders.append(ticket)
        held = sum(t.weight for t in holders)
        assert admission.active <= 3
        assert admission.active >= held
        # The line's count is exactly the waiters still waiting, whatever left from its middle.
        assert admission.queued == sum(1 for t, _ in tasks if not t.granted)
    for ticket in holders:
        ticket.release()
    for ticket, task in tasks:
        task.cancel()
        ticket.release()
    await settle()
    assert refused > 0
    assert (admission.active, admission.queued) == (0, 0)


async def test_a_line_emptied_from_its_middle_stays_small_and_counts_right() -> None:
    admission = pool(1, max_queue=0)
    holder = admission.enter()
    waiters = [admission.enter() for _ in range(1000)]
    # Everyone but the first and the last gives up: the leftovers are compacted away.
    for ticket in waiters[1:-1]:
        ticket.release()
    assert admission.queued == 2
    assert len(list(admission._line.tickets())) < 100
    holder.release()
    await waiters[0].wait()
    waiters[0].release()
    await waiters[-1].wait()
    assert waiters[-1].admitted
    waiters[-1].release()
    assert (admission.active, admission.queued) == (0, 0)


async def test_release_says_whether_it_handed_the_slot_to_a_waiter() -> None:
    admission = pool(1)
    first = admission.enter()
    second = admission.enter()
    assert first.release() is True  # `second` got the slot
    await second.wait()
    assert second.release() is False  # nobody was waiting


# -- while the capacity is unknown (llama-server starting or restarting) -------------------------


def starting(startup_wait_s: float = 5.0, **kwargs: float | None) -> Admission:
    queue_timeout_s = kwargs.pop("queue_timeout_s", None)
    return Admission(
        QueuePolicy(**kwargs),  # type: ignore[arg-type]
        queue_timeout_s=queue_timeout_s,
        startup_wait_s=startup_wait_s,
    )


async def test_unknown_capacity_lines_requests_up_and_admits_them_in_order_once_known() -> None:
    admission = starting()
    tickets = [admission.enter() for _ in range(3)]
    assert admission.awaiting_capacity
    order: list[int] = []

    async def wait(i: int, ticket: Ticket) -> None:
        await ticket.wait()
        order.append(i)

    tasks = [asyncio.create_task(wait(i, t)) for i, t in enumerate(tickets)]
    await settle()
    assert order == []
    assert (admission.active, admission.queued) == (0, 3)
    admission.resize(2)
    await settle()
    assert order == [0, 1]
    tickets[0].release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert not admission.awaiting_capacity


async def test_a_waiter_for_an_unknown_capacity_gets_not_ready_past_the_startup_wait() -> None:
    admission = starting(0.05)
    ticket = admission.enter()
    with pytest.raises(NotReady) as refused:
        await ticket.wait()
    assert refused.value.retry_after_s == 1.0
    assert admission.queued == 0
    admission.resize(1)
    assert admission.active == 0  # it left the line for good


async def test_a_shorter_queue_timeout_bounds_the_wait_for_capacity() -> None:
    admission = starting(60.0, queue_timeout_s=0.05)
    ticket = admission.enter()
    async with asyncio.timeout(5):
        with pytest.raises(NotReady):
            await ticket.wait()


async def test_once_the_capacity_is_known_a_waiter_stays_in_line_past_the_startup_wait() -> None:
    admission = starting(0.05)
    holder_wait = admission.enter()
    waiter = admission.enter()
    admission.resize(1)
    await holder_wait.wait()
    task = asyncio.create_task(waiter.wait())
    await asyncio.sleep(0.15)
    assert not task.done()
    holder_wait.release()
    await task
    assert waiter.admitted


@pytest.mark.parametrize(
    ("policy", "limit"),
    [({}, 64), ({"min_queue": 3}, 3), ({"max_queue": 2}, 2), ({"queue_per_slot": 0}, None)],
)
async def test_before_any_capacity_the_line_limit_is_min_queue(
    policy: dict[str, int], limit: int | None
) -> None:
    admission = starting(**policy)
    assert admission.queue_limit == limit
    if limit is not None:
        for _ in range(limit):
            admission.enter()
        with pytest.raises(QueueFull):
            admission.enter()


async def test_a_restart_keeps_the_last_known_line_limit() -> None:
    admission = starting(queue_per_slot=2)
    admission.resize(2)
    admission.resize(None)
    assert admission.queue_limit == 4
    for _ in range(4):
        admission.enter()
    with pytest.raises(QueueFull):
        admission.enter()


async def test_a_waiter_that_entered_unknown_is_weighed_once_the_capacity_is_known() -> None:
    admission = starting()

    def capped(capacity: int) -> int:
        return min(5, capacity)

    def refused(capacity: int) -> int:
        raise ValueError(f"needs 5 of {capacity}")

    array = admission.enter(5, weigh=capped)
    too_many = admission.enter(5, weigh=refused)
    light = admission.enter(1, weigh=lambda capacity: 1)
    admission.resize(2)
    await array.wait()
    assert (array.weight, admission.active) == (2, 2)
    with pytest.raises(ValueError, match="needs 5 of 2"):
        await too_many.wait()
    array.release()
    await light.wait()
    assert (admission.active, admission.queued) == (1, 0)


async def test_a_ticket_sent_back_waits_for_a_capacity_and_is_refused_past_its_deadline() -> None:
    admission = pool(1)
    first = admission.enter()
    admission.resize(None)  # its upstream went away
    first.reroute(time.monotonic() + 0.05)
    assert (admission.active, admission.queued) == (0, 1)
    with pytest.raises(NotReady):
        await first.wait()
    assert (admission.active, admission.queued) == (0, 0)
    admission.resize(1)
    third = admission.enter()
    admission.resize(None)
    third.reroute(time.monotonic() + 5)
    waiting = asyncio.create_task(third.wait())
    await settle()
    assert admission.awaiting_capacity
    admission.resize(1)
    await waiting
    assert third.admitted
    assert admission.active == 1


async def test_a_burst_turned_away_is_told_the_moments_places_free_not_the_whole_line() -> None:
    admission = pool(2, max_queue=4)
    for _ in range(4):
        admission._clock.observe(4.0)  # generations of about 4 s
    holders = [admission.enter() for _ in range(2)]
    waiters = [admission.enter() for _ in range(4)]
    told = []
    for _ in range(8):
        with pytest.raises(QueueFull) as refused:
            admission.enter()
        told.append(refused.value.retry_after_s)
    # Two slots, each freeing a place about every 4 s: the refusals are told successive
    # moments, two per hold, each a quarter to half a step (2 s) after it.
    for k, seconds in enumerate(told):
        moment = (k // 2 + 1) * 4.0
        assert moment + 0.5 - 0.01 <= seconds <= moment + 1.0 + 0.01, (k, told)
    for ticket in [*holders, *waiters]:
        ticket.release()


async def test_the_moments_promised_are_forgotten_once_they_pass() -> None:
    admission = pool(1, max_queue=1)
    admission._clock.observe(2.0)
    holder, waiter = admission.enter(), admission.enter()
    first = [admission._promise_s() for _ in range(3)]
    assert first[2] > first[0] + 3.5
    admission._clock.promised = [(at - 100, told - 100) for at, told in admission._clock.promised]
    assert admission._promise_s() < 3.1  # the next place again, not a fourth in a row
    holder.release()
    waiter.release()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.interpreted
def test_a_moment_promised_long_ago_does_not_keep_the_later_ones_that_passed_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    for module in (admission_module, clock_module, ticket_module):
        monkeypatch.setattr(module, "monotonic", clock.monotonic)
    admission = pool(1)
    admission._clock.observe(10.0)  # long generations: a refusal is told about 10 s
    holder = admission.enter()
    assert admission._promise_s() > 9.0
    for _ in range(60):
        admission._clock.observe(0.01)  # then the generations turn short
    assert max(admission._promise_s() for _ in range(50)) < 1.0
    clock.now += 2.0  # the fifty short moments have passed; the first one has not
    # One moment is still due, so the next refusal is told the one after it.
    assert admission._promise_s() <= admission.eta_s(2) + 0.01
    holder.release()


async def test_a_waiters_eta_counts_how_long_running_generations_have_held_their_slots() -> None:
    admission = pool(1)
    admission._clock.observe(2.0)
    holder = admission.enter()
    assert admission.eta_s(1) == pytest.approx(2.0, abs=0.05)  # just began: a hold to go
    granted_at, weight = admission._holders[holder]
    admission._holders[holder] = (granted_at - 10, weight)  # it has run 10 s already
    # Past the average, a generation is likely a long one: half as long again as it has run.
    assert admission.eta_s(1) == pytest.approx(5.0, abs=0.05)
    assert admission.eta_s(2) == pytest.approx(7.0, abs=0.05)  # then one more hold
    assert admission.retry_after_s(1) == pytest.approx(5.0, abs=0.05)
    holder.release()
    assert admission.eta_s(1) == 0.0


async def test_a_cold_gate_tells_nobody_more_than_two_guessed_holds() -> None:
    admission = pool(2, max_queue=1)
    admission.expect(3.0)  # a guess: no hold seen yet
    tickets = [admission.enter() for _ in range(3)]
    told = [admission._promise_s() for _ in range(12)]
    margin = 3.0 / 2 / 4  # a quarter of the step between places, and up to as much again
    assert 3.0 + margin - 0.01 <= told[0] <= 3.0 + 2 * margin + 0.01
    assert max(told) <= 2 * 3.0 + 2 * margin
    assert told[-1] >= 6.0 + margin - 0.01  # the later ones wait for real holds to be seen
    admission._clock.observe(1.0)
    # Warm: the twelve told about 6 s stand for the places that free about then, not for
    # twelve places from then on; the next is told the first place nobody was promised.
    assert admission._promise_s() == pytest.approx(1.0 + 0.5 / 4 * 1.5, abs=0.15)
    for ticket in tickets:
        ticket.release()


# -- a prompt array: one task per prompt, as many slots as the granting pool gives it ----------


async def test_a_prompt_array_waiting_while_its_upstream_restarts_larger_holds_its_tasks() -> None:
    admission = Admission(capacity=1)
    holder = admission.enter()
    # Four prompts, read while llama-server had one slot: it fills one slot then.
    array = admission.enter(1, tasks=4)
    assert array.weight == 1
    admission.resize(None)  # restarting...
    admission.resize(4)  # ...with four slots: llama-server runs the four prompts at once
    assert not array.granted  # three free slots are not four
    holder.release()
    await settle()
    assert array.granted
    assert (array.weight, admission.active) == (4, 4)
    array.release()
    assert admission.active == 0


async def test_a_prompt_array_sent_back_by_its_upstream_is_weighed_again_where_it_runs() -> None:
    admission = Admission(capacity=1)
    array = admission.enter(1, tasks=3)
    assert (array.weight, admission.active) == (1, 1)
    admission.resize(None)
    array.reroute(time.monotonic() + 5)
    admission.resize(4)
    await settle()
    assert array.granted
    assert (array.weight, admission.active) == (3, 3)
    array.release()
    assert admission.active == 0


class _Gate:
    """2 slots and 2 places whose holds last `hold_s` on a fake clock: `arrive` is one
    request, `advance` ends the holds that come due and lets their waiters resume."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold_s: float = 1.8) -> None:
        self.clock = _Clock()
        for module in (admission_module, clock_module, ticket_module):
            monkeypatch.setattr(module, "monotonic", self.clock.monotonic)
        self.admission = pool(2, max_queue=2)
        self.hold_s = hold_s
        self.tickets: list[Ticket] = []
        self.tasks: list[asyncio.Task[None]] = []

    def arrive(self) -> float | None:
        """None when it got a slot or a place, else the Retry-After it was told."""
        try:
            ticket = self.admission.enter()
        except QueueFull as refused:
            return refused.retry_after_s
        if not ticket.admitted:
            self.tasks.append(asyncio.create_task(ticket.wait()))
        self.tickets.append(ticket)
        return None

    def _due(self) -> float:
        ends = [
            t.admitted_at + self.hold_s
            for t in self.tickets
            if t.admitted_at is not None and not t._released
        ]
        return min(ends, default=math.inf)

    async def advance(self, seconds: float) -> None:
        end = self.clock.now + seconds
        while (due := self._due()) <= end:
            self.clock.now = due
            for ticket in self.tickets:
                at = ticket.admitted_at
                if at is not None and not ticket._released and at + self.hold_s <= due:
                    ticket.release()
            await settle()
        self.clock.now = end

    @property
    def idle(self) -> bool:
        return not self.admission.active and not self.admission.queued

    async def close(self) -> None:
        for ticket in self.tickets:
            ticket.release()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _place_frees_s(k: int, hold_s: float) -> float:
    """When the k-th place frees on 2 busy slots whose holds began together: k/2 holds."""
    return (k + 1) // 2 * hold_s


@pytest.mark.interpreted
async def test_a_cold_burst_coming_back_together_is_told_the_places_that_free_not_the_line_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = _Gate(monkeypatch)
    gate.admission.expect(2.0)  # a guess: no hold seen yet
    first = [gate.arrive() for _ in range(40)]
    refused = [told for told in first if told is not None]
    assert len(refused) == 36
    # Each comes back when told (the cold estimate: about two guessed holds, all together).
    start = gate.clock.now
    again = []
    for seconds in sorted(refused):
        await gate.advance(start + seconds - gate.clock.now)
        told_again = gate.arrive()
        if told_again is not None:
            again.append((gate.clock.now + told_again, told_again))
    told = sorted(seconds for _, seconds in again)
    assert told
    for k, seconds in enumerate(told, start=1):
        assert seconds <= 2 * _place_frees_s(k, gate.hold_s) + 1.0, (k, told)
    # Each comes back once more when told (an SDK's last try): each finds a place.
    last = []
    for moment, _ in sorted(again):
        await gate.advance(moment - gate.clock.now)
        last.append(gate.arrive())
    assert last.count(None) == len(last), last
    await gate.close()


@pytest.mark.interpreted
async def test_an_estimate_after_impatient_clients_is_within_twice_the_wait_it_then_sees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = _Gate(monkeypatch)
    for _ in range(16):  # twelve clients come back every 0.5 s for 8 s, whatever told
        for _ in range(12):
            gate.arrive()
        await gate.advance(0.5)
    while not gate.idle:
        await gate.advance(0.1)
    burst = [gate.arrive() for _ in range(12)]
    told = [t for t in burst if t is not None]
    assert len(told) == 8
    for k, seconds in enumerate(told, start=1):
        assert seconds <= 2 * _place_frees_s(k, gate.hold_s) + 0.5, (k, told)
    await gate.close()


async def test_the_estimate_shown_is_the_one_a_refusal_would_be_told_now() -> None:
    admission = pool(2)  # a line of 64
    for _ in range(4):
        admission._clock.observe(4.0)
    tickets = [admission.enter() for _ in range(2 + 64)]
    shown = admission.estimate_s()
    with pytest.raises(QueueFull) as refused:
        admission.enter()
    # The next place frees with the next slot: about a hold, not the whole line's 60 s.
    assert shown == pytest.approx(refused.value.retry_after_s, abs=4.0 / 2 / 4 + 0.01)
    assert shown < 5.0
    for ticket in tickets:
        ticket.release()


@pytest.mark.interpreted
async def test_a_client_refused_again_and_again_stands_for_one_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = _Gate(monkeypatch, hold_s=10.0)
    for _ in range(4):
        gate.arrive()
    gate.admission._clock.observe(10.0)
    told = []
    for _ in range(18):  # every 0.5 s, whatever it was told, until the first slot frees
        told.append(gate.arrive())
        await gate.advance(0.5)
    # The first place frees with the first slot, at 10 s: told a little after it each time,
    # counting down as it nears, never pushed out by its own earlier refusals.
    assert all(t is not None and t <= 10.0 + 2.5 for t in told), told
    await gate.close()


@pytest.mark.interpreted
async def test_a_burst_at_short_holds_is_spread_over_the_places_that_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = _Gate(monkeypatch, hold_s=0.05)
    for _ in range(4):
        gate.arrive()
    for _ in range(3):
        gate.admission._clock.observe(0.05)
    told = [gate.arrive() for _ in range(200)]
    # Two places a hold: the 200th about a hundred holds out, not told the first place as
    # if each refusal had kept the promise told an instant before it.
    assert all(t is not None for t in told)
    assert max(t for t in told if t is not None) >= 0.8 * 100 * 0.05, told[-5:]
    await gate.close()


async def test_a_pause_keeps_every_waiter_and_resume_grants_them_in_arrival_order() -> None:
    admission = pool(1)
    running = admission.enter()
    admission.pause()
    waiters = [admission.enter() for _ in range(3)]
    assert not any(w.admitted for w in waiters)
    waits = [asyncio.ensure_future(w.wait()) for w in waiters]
    running.release()  # its slot goes to nobody while paused
    await settle()
    assert (admission.active, admission.queued, admission.paused) == (0, 3, True)
    assert not any(w.done() for w in waits)
    admission.resume()
    await settle()
    assert waits[0].done()
    assert not waits[1].done()
    assert [w.granted for w in waiters] == [True, False, False]
    for w in waiters:
        w.release()
        await settle()
    assert all(w.done() for w in waits)


async def test_a_paused_line_keeps_its_limit_and_its_timeout() -> None:
    admission = Admission(QueuePolicy(max_queue=1), capacity=1, queue_timeout_s=0.05)
    admission.pause()
    waiter = admission.enter()  # a free slot, but paused: it waits
    assert not waiter.admitted
    with pytest.raises(QueueFull):
        admission.enter()
    with pytest.raises(QueueTimeout):
        await waiter.wait()
    assert (admission.active, admission.queued) == (0, 0)


async def test_a_drained_pool_runs_its_requests_to_their_end_and_takes_no_new_one() -> None:
    admission = Admission(QueuePolicy(), epsilon=1.0)
    first, second = admission.add_pool("a"), admission.add_pool("b")
    first.resize(1)
    second.resize(1)
    held = [admission.enter(), admission.enter()]
    on_first = next(t for t in held if t.pool is first)
    first.drain()
    assert (admission.capacity, first.draining, first.active) == (1, True, 1)
    first.resize(1)  # its upstream's next reading keeps it out
    assert admission.capacity == 1
    on_first.release()  # finishes as ever
    waiter = admission.enter()
    assert not waiter.admitted  # the drained pool has a free slot: not for new work
    other = next(t for t in held if t is not on_first)
    other.release()
    await waiter.wait()
    assert waiter.pool is second
    first.restore()
    assert (admission.capacity, first.draining) == (2, False)
    assert admission.enter().pool is first


async def test_a_shutdown_while_paused_turns_the_waiters_away_and_a_resume_grants_nobody() -> None:
    admission = pool(1)
    running = admission.enter()
    admission.pause()
    waiter = admission.enter()
    admission.close()
    with pytest.raises(ShuttingDown):
        await waiter.wait()
    admission.resume()  # after the close: still closed
    running.release()
    assert (admission.active, admission.queued, admission.paused) == (0, 0, False)
    with pytest.raises(ShuttingDown):
        admission.enter()


async def test_a_cancelled_waiter_handed_the_slot_by_a_resume_passes_it_on() -> None:
    admission = pool(1)
    admission.pause()
    first, second = admission.enter(), admission.enter()
    waiting = asyncio.ensure_future(first.wait())
    await settle()
    admission.resume()  # hands the slot to `first`, whose task has not run yet
    waiting.cancel()  # an operator's cancel, or its client leaving, at that moment
    await asyncio.gather(waiting, return_exceptions=True)
    first.release()
    assert second.granted
    assert (admission.active, admission.queued) == (1, 0)
    second.release()
    assert admission.active == 0
