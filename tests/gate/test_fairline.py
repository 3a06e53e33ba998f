"""The fair line on its own: bands, weighted shares of slot time, limits, put-backs, leavers.

Holds are simulated on a fake clock (`Run`): nothing sleeps, and every figure is exact.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from slotgate.gate.fairline import FairLine
from slotgate.gate.tenants import BATCH, INTERACTIVE, Tenant

_seqs = itertools.count()


class Future:
    """As much of an asyncio future as the line reads."""

    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled


@dataclass(eq=False)
class Ticket:
    tenant: Tenant
    band: int = INTERACTIVE
    weight: int = 1
    seq: int = field(default_factory=lambda: next(_seqs))
    _future: Future | None = field(default_factory=Future)
    granted_at: float | None = None


def tickets(tenant: Tenant, count: int, band: int | None = None) -> list[Ticket]:
    return [Ticket(tenant, tenant.band if band is None else band) for _ in range(count)]


def cancel(line: FairLine[Ticket], ticket: Ticket) -> None:
    assert ticket._future is not None
    ticket._future.cancelled = True
    line.leave(ticket)


class Run:
    """`capacity` slots in front of a fair line, on a fake clock: each grant holds its slots
    for `hold(ticket)` simulated seconds."""

    def __init__(
        self, line: FairLine[Ticket], capacity: int, hold: Callable[[Ticket], float]
    ) -> None:
        self.line = line
        self.free = capacity
        self.hold = hold
        self.now = 0.0
        self.running: list[tuple[float, int, Ticket]] = []
        self.order: list[Ticket] = []
        self.slot_s: dict[str, float] = {}
        self.peak: dict[str, int] = {}

    def dispatch(self) -> None:
        line = self.line
        while (head := line.head()) is not None and head.weight <= self.free:
            assert line.pop_head() is head
            line.granted(head)
            self.free -= head.weight
            head.granted_at = self.now
            self.order.append(head)
            end = self.now + self.hold(head)
            heapq.heappush(self.running, (end, head.seq, head))
            name = head.tenant.name
            self.peak[name] = max(self.peak.get(name, 0), line.counts(name)[0])

    def step(self) -> Ticket:
        """Let the next hold end; returns whose it was."""
        end, _, ticket = heapq.heappop(self.running)
        self.now = end
        assert ticket.granted_at is not None
        held_s = end - ticket.granted_at
        name = ticket.tenant.name
        self.slot_s[name] = self.slot_s.get(name, 0.0) + held_s * ticket.weight
        self.line.released(ticket, held_s)
        self.free += ticket.weight
        self.dispatch()
        return ticket

    def until(self, done: Callable[[], bool]) -> None:
        while self.running and not done():
            self.step()


def fed(capacity: int, hold: Callable[[Ticket], float], *waiters: list[Ticket]) -> Run:
    line: FairLine[Ticket] = FairLine()
    for ticket in itertools.chain(*waiters):
        line.push(ticket)
    run = Run(line, capacity, hold)
    run.dispatch()
    return run


def test_one_tenant_is_served_in_exactly_the_order_it_came() -> None:
    solo = Tenant("solo")
    waiters = tickets(solo, 200)
    rng = random.Random(7)
    run = fed(3, lambda t: rng.uniform(0.1, 5.0), waiters)
    run.until(lambda: False)
    assert run.order == waiters
    assert run.line.counts("solo") == (0, 0)


@pytest.mark.parametrize(
    ("capacity", "hold_a", "hold_b"),
    [
        (4, (1.0, 1.0), (1.0, 1.0)),  # equal fixed holds
        (2, (0.5, 1.5), (0.5, 1.5)),  # equal random holds
        (8, (0.1, 0.4), (2.0, 6.0)),  # the light tenant's holds are the short ones
        (3, (2.0, 6.0), (0.1, 0.4)),  # ... the long ones
        (1, (0.2, 3.0), (0.2, 3.0)),  # one slot
    ],
)
def test_weights_three_to_one_share_slot_seconds_three_to_one(
    capacity: int, hold_a: tuple[float, float], hold_b: tuple[float, float]
) -> None:
    heavy, light = Tenant("heavy", weight=3), Tenant("light", weight=1)
    rng = random.Random(capacity)
    holds = {"heavy": hold_a, "light": hold_b}
    run = fed(
        capacity,
        lambda t: rng.uniform(*holds[t.tenant.name]),
        tickets(heavy, 20_000),
        tickets(light, 20_000),
    )
    run.until(lambda: len(run.order) >= 5_000)
    # Both stayed saturated throughout: neither ran out of waiters.
    assert min(run.line.counts("heavy")[1], run.line.counts("light")[1]) > 0
    ratio = run.slot_s["heavy"] / run.slot_s["light"]
    assert 3 * 0.95 <= ratio <= 3 * 1.05, ratio


def test_a_burst_of_grants_is_spread_over_the_tenants_by_weight() -> None:
    a, b = Tenant("a", weight=2), Tenant("b")
    run = fed(9, lambda t: 1.0, tickets(a, 20), tickets(b, 20))
    assert Counter(t.tenant.name for t in run.order) == {"a": 6, "b": 3}


def test_a_higher_band_is_served_first_and_a_lower_one_when_it_has_nobody_waiting() -> None:
    chat = Tenant("chat", band=INTERACTIVE)
    bulk = Tenant("bulk", band=BATCH)
    urgent = Tenant("urgent", band=5)
    waiters = [*tickets(bulk, 5), *tickets(chat, 3), *tickets(urgent, 2)]
    run = fed(1, lambda t: 1.0, waiters)
    run.until(lambda: False)
    assert [t.tenant.name for t in run.order] == ["urgent"] * 2 + ["chat"] * 3 + ["bulk"] * 5


def test_a_lowered_request_waits_behind_its_own_tenants_higher_band() -> None:
    chat = Tenant("chat")
    background = tickets(chat, 3, band=BATCH)
    foreground = tickets(chat, 2)
    run = fed(1, lambda t: 1.0, background, foreground)
    run.until(lambda: False)
    assert run.order == [*foreground, *background]


@pytest.mark.parametrize(("capacity", "limit"), [(4, 1), (4, 3), (6, 2), (2, 2)])
def test_max_active_is_never_exceeded_and_the_other_slots_are_used(
    capacity: int, limit: int
) -> None:
    capped, free = Tenant("capped", weight=10, max_active=limit), Tenant("free")
    rng = random.Random(limit)
    run = fed(capacity, lambda t: rng.uniform(0.5, 2.0), tickets(capped, 300), tickets(free, 300))
    busy: list[int] = []
    while run.line.counts("capped")[1] and run.line.counts("free")[1]:
        busy.append(capacity - run.free)
        run.step()
    assert run.peak["capped"] == limit
    # Work conservation: while both have waiters, every slot is held.
    assert set(busy) == {capacity}


def test_a_tenant_at_max_active_passes_its_turn_to_a_lower_band() -> None:
    capped = Tenant("capped", max_active=1)
    bulk = Tenant("bulk", band=BATCH)
    run = fed(2, lambda t: 1.0, tickets(capped, 3), tickets(bulk, 3))
    assert [t.tenant.name for t in run.order] == ["capped", "bulk"]


def test_a_ticket_put_back_at_the_front_is_served_next_in_its_band() -> None:
    a, b = Tenant("a"), Tenant("b")
    line: FairLine[Ticket] = FairLine()
    first = Ticket(a)
    line.push(first)
    assert line.pop_head() is first
    line.granted(first)
    for ticket in [*tickets(b, 3), *tickets(a, 3)]:
        line.push(ticket)
    # Its upstream failed at once: it gives the slot back and goes ahead of everyone.
    line.released(first, 0.0)
    line.push_front(first)
    assert line.counts("a") == (0, 4)
    assert line.head() is first
    assert line.pop_head() is first
    line.granted(first)
    assert line.counts("a") == (1, 3)


def test_waiters_who_leave_are_skipped_and_uncounted_at_once() -> None:
    a, b = Tenant("a"), Tenant("b")
    waiters_a, waiters_b = tickets(a, 6), tickets(b, 6)
    line: FairLine[Ticket] = FairLine()
    for ticket in itertools.chain(*zip(waiters_a, waiters_b, strict=True)):
        line.push(ticket)
    for ticket in (waiters_a[0], waiters_a[1], waiters_a[5], waiters_b[2]):
        cancel(line, ticket)
    assert line.counts("a") == (0, 3)
    assert line.counts("b") == (0, 5)
    assert len(line) == 8
    run = Run(line, 1, lambda t: 1.0)
    run.dispatch()
    run.until(lambda: False)
    assert set(run.order) == {*waiters_a[2:5], *waiters_b[:2], *waiters_b[3:]}
    assert [t for t in run.order if t.tenant is a] == waiters_a[2:5]
    assert line.head() is None
    assert len(line) == 0


def test_a_line_of_leavers_is_compacted_as_they_leave() -> None:
    solo = Tenant("solo")
    line: FairLine[Ticket] = FairLine()
    waiters = tickets(solo, 1_000)
    for ticket in waiters:
        line.push(ticket)
    for ticket in waiters[1:-1:2] + waiters[:-1:2]:
        cancel(line, ticket)
    assert len(line) == 1
    assert len(list(line.tickets())) <= 2 * 1 + 64 + 1
    assert line.pop_head() is waiters[-1]


def test_an_interactive_tenant_behind_a_flood_waits_under_one_hold() -> None:
    flood, chat = Tenant("flood"), Tenant("chat")
    hold_s = 10.0
    run = fed(2, lambda t: hold_s, tickets(flood, 1_000))
    asked: list[Ticket] = []
    for _ in range(20):  # every few holds, one chat request
        run.until(lambda: run.now >= hold_s * 2.5 * (len(asked) + 1))
        ticket = Ticket(chat)
        ticket.granted_at = None
        asked.append(ticket)
        arrived = run.now
        run.line.push(ticket)
        run.dispatch()
        run.until(lambda t=ticket: t.granted_at is not None)  # type: ignore[misc]
        assert ticket.granted_at is not None
        assert ticket.granted_at - arrived <= hold_s
    assert run.line.counts("flood")[1] > 900


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    steady, returning = Tenant("steady"), Tenant("returning")
    run = fed(1, lambda t: 1.0, tickets(steady, 200), tickets(returning, 1))
    run.until(lambda: run.now >= 100)  # `returning` was idle for about 99 holds
    for ticket in tickets(returning, 50):
        run.line.push(ticket)
    start = len(run.order)
    run.until(lambda: len(run.order) >= start + 20)
    after = Counter(t.tenant.name for t in run.order[start : start + 20])
    assert abs(after["returning"] - after["steady"]) <= 2, after


def test_a_granted_request_that_never_waited_is_charged_too() -> None:
    a, b = Tenant("a"), Tenant("b")
    line: FairLine[Ticket] = FairLine()
    for _ in range(3):  # `a` was admitted three times at once, with nobody waiting
        ticket = Ticket(a)
        line.granted(ticket)
        line.released(ticket, 5.0)
    first_a, first_b = Ticket(a), Ticket(b)
    line.push(first_a)
    line.push(first_b)
    assert line.counts("a") == (0, 1)
    assert line.head() is first_b


def test_a_reload_that_raises_max_active_lets_the_tenant_run_more() -> None:
    capped = Tenant("capped", max_active=1)
    line: FairLine[Ticket] = FairLine()
    first, second = Ticket(capped), Ticket(capped)
    line.push(first)
    line.push(second)
    line.granted(line.pop_head())
    assert line.head() is None
    line.retune([Tenant("capped", max_active=2)])
    assert line.head() is second


def test_drain_hands_back_every_live_waiter() -> None:
    a, b = Tenant("a"), Tenant("b")
    line: FairLine[Ticket] = FairLine()
    waiters = [*tickets(a, 3), *tickets(b, 3)]
    for ticket in waiters:
        line.push(ticket)
    cancel(line, waiters[0])
    assert set(line.drain()) == set(waiters[1:])
    assert len(line) == 0
    assert line.head() is None


def expected_head(line: FairLine[Ticket]) -> Ticket | None:
    """The head by brute force over every flow, from the line's own virtual times."""
    best: tuple[int, float, int, Ticket] | None = None
    for flow in line._flows.values():
        live = [t for t in (*flow.front, *flow.line) if not t._future or not t._future.done()]
        if not live:
            continue
        head = live[0]
        account = flow.account
        limit = account.max_active
        if limit is not None and account.active and account.active + head.weight > limit:
            continue
        key = (-flow.band.level, -math.inf if head in flow.front else flow.vt, head.seq, head)
        if best is None or key[:3] < best[:3]:
            best = key  # type: ignore[assignment]
    return best[3] if best is not None else None


@pytest.mark.parametrize("seed", range(6))
def test_the_head_is_always_the_one_a_search_of_every_flow_finds(seed: int) -> None:
    rng = random.Random(seed)
    tenants = [
        Tenant(f"t{n}", weight=rng.choice([0.5, 1, 3]), max_active=rng.choice([None, 1, 2]))
        for n in range(12)
    ]
    line: FairLine[Ticket] = FairLine()
    waiting: list[Ticket] = []
    running: list[Ticket] = []
    for _ in range(4_000):
        action = rng.random()
        if action < 0.45:
            ticket = Ticket(rng.choice(tenants), band=rng.choice([BATCH, INTERACTIVE, 3]))
            line.push(ticket)
            waiting.append(ticket)
        elif action < 0.55 and waiting:
            ticket = waiting.pop(rng.randrange(len(waiting)))
            cancel(line, ticket)
        elif action < 0.85 and len(running) < 6:
            head = line.head()
            assert head is expected_head(line)
            if head is not None:
                assert line.pop_head() is head
                waiting.remove(head)
                line.granted(head)
                running.append(head)
        elif running:
            ticket = running.pop(rng.randrange(len(running)))
            line.released(ticket, rng.uniform(0, 3))
            if rng.random() < 0.1:  # a failover: back in line, at the front
                line.push_front(ticket)
                waiting.append(ticket)
        assert line.head() is expected_head(line)
        assert len(line) == len(waiting)
        for band in line._bands.values():
            assert len(band.heap) <= 2 * band.flows + 64 + 1
            assert band.busy == sum(1 for f in line._flows.values() if f.band is band and f.live)


def test_a_tenant_back_from_idle_is_not_put_behind_by_a_wrong_first_guess_of_the_hold() -> None:
    steady, returning = Tenant("steady"), Tenant("returning")
    line: FairLine[Ticket] = FairLine(hold_s=100.0)  # holds turn out to take 1 s
    run = Run(line, 2, lambda t: 1.0)
    for ticket in tickets(steady, 300):
        line.push(ticket)
    run.dispatch()
    run.until(lambda: run.now >= 20)
    late = Ticket(returning)
    line.push(late)
    start = len(run.order)
    run.until(lambda: late.granted_at is not None)
    assert run.order.index(late) - start <= 2
