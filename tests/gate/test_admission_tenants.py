"""The admission core with tenants: the line turns fair when a second tenant or band comes."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest
from slotgate.errors import QueueFull, ShuttingDown, TenantQueueFull, TooLarge, refusal
from slotgate.gate.admission import Admission
from slotgate.gate.fairline import FairLine
from slotgate.gate.policy import QueuePolicy
from slotgate.gate.tenants import BATCH, Tenant
from slotgate.gate.ticket import Ticket

FLOOD = Tenant("flood")
CHAT = Tenant("chat")


def pool(capacity: int = 1, **policy: int | None) -> Admission:
    return Admission(QueuePolicy(**policy), capacity=capacity)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def waiters(
    admission: Admission, tenant: Tenant, count: int, band: int | None = None
) -> list[Ticket]:
    return [admission.enter(tenant=tenant, band=band) for _ in range(count)]


async def served(admission: Admission, holder: Ticket, line: list[Ticket]) -> list[Ticket]:
    """Release the holder, then each newly admitted one, until the line is empty: the order
    in which `line` was served."""
    order: list[Ticket] = []
    while True:
        holder.release()
        await settle()
        admitted = [t for t in line if t.granted and t not in order]
        if not admitted:
            return order
        assert len(admitted) == 1
        order.append(admitted[0])
        holder = admitted[0]


async def test_one_tenant_keeps_todays_plain_line() -> None:
    admission = pool(1)
    holder = admission.enter(tenant=CHAT)
    line = waiters(admission, CHAT, 20)
    assert not isinstance(admission._line, FairLine)
    assert await served(admission, holder, line) == line


async def test_a_second_tenant_is_served_before_a_flood_already_waiting() -> None:
    admission = pool(1)
    holder = admission.enter(tenant=FLOOD)
    flood = waiters(admission, FLOOD, 50)
    tasks = [asyncio.create_task(t.wait()) for t in flood]
    chat = admission.enter(tenant=CHAT)
    chat_task = asyncio.create_task(chat.wait())
    await settle()
    assert admission.tenant_counts("flood") == (1, 50)  # it holds the slot
    assert admission.tenant_counts("chat") == (0, 1)
    holder.release()
    await chat_task
    assert chat.admitted
    assert not any(t.granted for t in flood)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert admission.queued == 0


async def test_the_waiters_in_line_keep_their_order_when_the_line_turns_fair() -> None:
    admission = pool(1)
    holder = admission.enter(tenant=FLOOD)
    flood = waiters(admission, FLOOD, 5)
    flood[2].release()  # gave up before the line turned fair
    batch = admission.enter(tenant=FLOOD, band=BATCH)
    assert isinstance(admission._line, FairLine)
    assert admission.queued == 5
    order = await served(admission, holder, [*flood, batch])
    assert order == [flood[0], flood[1], flood[3], flood[4], batch]


async def test_a_lowered_band_waits_behind_the_same_tenants_own_chat() -> None:
    admission = pool(1)
    holder = admission.enter(tenant=CHAT)
    background = waiters(admission, CHAT, 3, band=BATCH)
    foreground = waiters(admission, CHAT, 2)
    assert await served(admission, holder, [*background, *foreground]) == [
        *foreground,
        *background,
    ]


async def test_a_tenant_at_max_queued_is_refused_while_others_still_get_in() -> None:
    capped = Tenant("capped", max_queued=2)
    admission = pool(1, max_queue=10)
    holder = admission.enter(tenant=capped)
    waiters(admission, capped, 2)
    with pytest.raises(TenantQueueFull) as refused:
        admission.enter(tenant=capped)
    snapshot = refused.value.snapshot
    assert snapshot.tenant is not None
    assert (snapshot.tenant.name, snapshot.tenant.active, snapshot.tenant.queued) == (
        "capped",
        1,
        2,
    )
    assert snapshot.queued == 2
    assert refused.value.retry_after_s >= 1
    other = admission.enter(tenant=CHAT)
    assert admission.queued == 3
    other.release()
    holder.release()


async def test_the_global_line_limit_still_holds_with_tenants() -> None:
    admission = pool(1, max_queue=3)
    admission.enter(tenant=FLOOD)
    waiters(admission, FLOOD, 2)
    admission.enter(tenant=CHAT)
    with pytest.raises(QueueFull) as refused:
        admission.enter(tenant=CHAT)
    assert not isinstance(refused.value, TenantQueueFull)


async def test_a_tenant_at_max_active_waits_while_another_takes_the_free_slot() -> None:
    capped = Tenant("capped", max_active=1)
    admission = pool(3)
    first = admission.enter(tenant=capped)
    second = admission.enter(tenant=capped)
    assert first.admitted
    assert not second.admitted
    # Slots are free and the only waiter may not run: a newcomer takes one at once.
    other = admission.enter(tenant=CHAT)
    assert other.admitted
    assert admission.tenant_counts("capped") == (1, 1)
    task = asyncio.create_task(second.wait())
    first.release()
    await task
    assert admission.tenant_counts("capped") == (1, 0)


async def test_a_reload_that_lifts_max_active_admits_at_once() -> None:
    admission = pool(2)
    first = admission.enter(tenant=Tenant("capped", max_active=1))
    second = admission.enter(tenant=Tenant("capped", max_active=1))
    task = asyncio.create_task(second.wait())
    await settle()
    assert not second.admitted
    admission.retune([Tenant("capped", max_active=2)])
    await task
    assert second.admitted
    first.release()
    second.release()


async def test_a_ticket_sent_back_by_its_upstream_is_next_in_a_fair_line() -> None:
    admission = pool(1)
    first = admission.enter(tenant=CHAT)
    flood = waiters(admission, FLOOD, 3)
    more_chat = admission.enter(tenant=CHAT)
    first.reroute(time.monotonic() + 5)
    # Back at the head of the line, it got the slot it gave back at once.
    assert (admission.active, admission.queued) == (1, 4)
    assert first.granted
    await first.wait()
    assert first.admitted
    assert not any(t.granted for t in [*flood, more_chat])


async def test_shutdown_turns_away_every_waiter_of_a_fair_line() -> None:
    admission = pool(1)
    admission.enter(tenant=CHAT)
    line = [*waiters(admission, FLOOD, 3), *waiters(admission, CHAT, 2)]
    admission.close()
    for ticket in line:
        with pytest.raises(ShuttingDown):
            await ticket.wait()
    assert admission.queued == 0


async def test_a_waiter_who_gives_up_leaves_its_tenants_count_and_is_skipped() -> None:
    admission = pool(1)
    holder = admission.enter(tenant=CHAT)
    flood = waiters(admission, FLOOD, 3)
    admission.enter(tenant=CHAT)
    task = asyncio.create_task(flood[0].wait())
    await settle()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert admission.tenant_counts("flood") == (0, 2)
    assert admission.queued == 3
    holder.release()  # the flood is furthest behind: its next live waiter
    assert flood[1].granted
    assert admission.tenant_counts("flood") == (1, 1)
    assert admission.queued == 2


async def test_a_waiters_position_counts_the_other_tenants_turns() -> None:
    admission = pool(1)
    admission.enter(tenant=FLOOD)
    flood = waiters(admission, FLOOD, 10)
    chat = waiters(admission, CHAT, 2)
    assert chat[0].position == 1
    assert chat[1].position == 3  # the flood's next one goes between
    assert flood[3].position == 7
    assert flood[9].position == 12  # never past the whole line


@pytest.mark.parametrize("seed", range(4))
async def test_random_work_of_many_tenants_keeps_every_count_and_limit(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [
        Tenant(f"t{n}", weight=rng.choice([1, 2]), band=rng.choice([BATCH, 1, 3]),
               max_active=rng.choice([None, 1, 2]), max_queued=rng.choice([None, 3]))
        for n in range(6)
    ]  # fmt: skip
    admission = pool(4, max_queue=40)
    tickets: list[Ticket] = []
    for _ in range(1_500):
        action = rng.random()
        if action < 0.4:
            tenant = rng.choice(tenants)
            band = rng.choice([None, None, BATCH])
            with contextlib.suppress(QueueFull):
                tickets.append(admission.enter(tenant=tenant, band=band))
        elif action < 0.55 and tickets:
            tickets.pop(rng.randrange(len(tickets))).release()  # a waiter leaves, or a holder
        elif action < 0.85:
            held = [t for t in tickets if t.granted]
            if held:
                ticket = rng.choice(held)
                tickets.remove(ticket)
                ticket.release()
        elif action < 0.9:
            held = [t for t in tickets if t.granted]
            if held:
                rng.choice(held).reroute(time.monotonic() + 5)
        else:
            admission.resize(rng.choice([2, 4, 6]))
        live = [t for t in tickets if not t._released]
        granted = [t for t in live if t.granted]
        waiting = [t for t in live if not t.granted]
        assert admission.active == sum(t.weight for t in granted)
        assert admission.queued == len(waiting)
        fair = admission._line
        if isinstance(fair, FairLine):
            assert fair.queued == len(waiting)
            for tenant in tenants:
                mine = [t for t in granted if t.tenant.name == tenant.name]
                queued = [t for t in waiting if t.tenant.name == tenant.name]
                active = admission.tenant_counts(tenant.name)[0]
                assert admission.tenant_counts(tenant.name)[1] == len(queued)
                # Slots held from before the line turned fair are not counted.
                assert active <= len(mine)
                if tenant.max_active is not None:
                    assert active <= tenant.max_active
        # Work conservation: a slot is free only if nobody waiting may run.
        capacity = admission.capacity or 0
        if admission.active < capacity and fair is not None:
            head = fair.head()
            assert head is None or head.weight > capacity - admission.active
    assert isinstance(admission._line, FairLine)
    for ticket in tickets:
        ticket.release()
    assert (admission.active, admission.queued) == (0, 0)


async def test_a_request_counts_its_weight_against_its_tenants_max_active() -> None:
    capped = Tenant("capped", max_active=2)
    admission = pool(4)
    with pytest.raises(TooLarge) as refused:
        admission.enter(3, tenant=capped)
    assert "max_active" in refusal(refused.value).message
    one = admission.enter(1, tenant=capped)
    two = admission.enter(2, tenant=capped)
    assert one.admitted
    assert not two.granted  # 1 + 2 is over 2, although two slots are free
    one.release()
    await settle()
    assert two.granted
    assert admission.tenant_counts("capped") == (2, 0)
    two.release()


async def test_a_reload_lowering_max_active_below_a_waiters_weight_refuses_it() -> None:
    admission = pool(4)
    holder = admission.enter(tenant=Tenant("capped", max_active=2))
    pair = admission.enter(2, tenant=Tenant("capped", max_active=2))
    task = asyncio.create_task(pair.wait())
    await settle()
    assert not pair.granted
    admission.retune([Tenant("capped", max_active=1)])
    with pytest.raises(TooLarge) as refused:
        await task
    assert "max_active=1" in refusal(refused.value).message
    assert admission.tenant_counts("capped") == (1, 0)
    holder.release()
    assert (admission.active, admission.queued) == (0, 0)


async def test_the_first_tenants_running_slots_count_as_held_once_a_second_tenant_comes() -> None:
    admission = pool(2)
    running = waiters(admission, FLOOD, 2)
    queued = waiters(admission, FLOOD, 1)
    assert not isinstance(admission._line, FairLine)
    chat = admission.enter(tenant=CHAT)  # the line turns fair here
    assert admission.tenant_counts("flood") == (2, 1)
    running[0].release()
    await settle()
    # The slot went to one of the two waiting; either way, held slots are counted exactly.
    assert sum(admission.tenant_counts(name)[0] for name in ("flood", "chat")) == 2
    for ticket in [*running, *queued, chat]:
        ticket.release()
    assert admission.tenant_counts("flood") == (0, 0)
    assert admission.tenant_counts("chat") == (0, 0)


async def test_a_reload_at_the_switch_holds_the_first_tenant_to_its_new_max_active() -> None:
    admission = pool(3)
    running = waiters(admission, FLOOD, 3)
    more = waiters(admission, FLOOD, 2)
    chat = admission.enter(tenant=CHAT)
    admission.retune([Tenant("flood", max_active=1)])
    tasks = [asyncio.create_task(t.wait()) for t in [*more, chat]]
    running[0].release()
    await settle()
    running[1].release()
    await settle()
    # It still holds one slot, its limit: neither of its waiters may run yet.
    assert not any(t.granted for t in more)
    assert admission.tenant_counts("flood") == (1, 2)
    running[2].release()
    await settle()
    assert sum(t.granted for t in more) == 1
    for ticket in [*more, chat]:
        ticket.release()
    await asyncio.gather(*tasks, return_exceptions=True)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.interpreted
@pytest.mark.parametrize("first", ["heavy", "light"])
async def test_a_light_tenant_gets_its_weighted_share_from_the_switch_on(
    monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    from slotgate.gate import admission as admission_module
    from slotgate.gate import clock as clock_module
    from slotgate.gate import ticket as ticket_module

    clock = _Clock()
    for module in (admission_module, clock_module, ticket_module):
        monkeypatch.setattr(module, "monotonic", clock.monotonic)
    tenants = {"heavy": Tenant("heavy", weight=9.0), "light": Tenant("light", weight=1.0)}
    admission = pool(2, max_queue=0)
    admission.expect(100.0)  # a cold estimate far off the real 2 s, as a large max_tokens gives
    running = waiters(admission, tenants[first], 2)
    line = [*waiters(admission, tenants[first], 80)]
    line += waiters(admission, tenants["light" if first == "heavy" else "heavy"], 80)
    tasks = [asyncio.create_task(t.wait()) for t in line]
    await settle()
    holders = list(running)
    grants: list[str] = []
    while len(grants) < 60:
        clock.now += 1.0  # every generation holds its slot 2 s, staggered by 1 s
        holders.pop(0).release()
        await settle()
        granted = [t for t in line if t.admitted_at == clock.now]
        holders += granted
        grants += [t.tenant.name for t in granted]
    assert 0.05 <= grants[:60].count("light") / 60 <= 0.15, grants
    for ticket in line:
        ticket.release()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_reload_before_the_switch_holds_the_first_tenant_to_its_new_max_active() -> None:
    admission = pool(3)
    running = waiters(admission, FLOOD, 3)
    capped = Tenant("flood", max_active=1)
    admission.retune([capped])  # its next request turns the line fair
    more = waiters(admission, capped, 2)
    assert admission.tenant_counts("flood") == (3, 2)
    tasks = [asyncio.create_task(t.wait()) for t in more]
    running[0].release()
    running[1].release()
    await settle()
    assert not any(t.granted for t in more)  # it still holds one slot, its limit
    running[2].release()
    await settle()
    assert sum(t.granted for t in more) == 1
    for ticket in more:
        ticket.release()
    await asyncio.gather(*tasks, return_exceptions=True)
